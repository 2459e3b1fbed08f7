//! Planning a save: tensors → files → byte ranges, and the header safetensors would write.
//!
//! Pure computation, the mirror of planning a load. [`plan_file`] lays out one file exactly as
//! safetensors' `save_file` does (tensors sorted by dtype, widest first, then by name; each
//! tensor's bytes right after the previous one's; the header padded to 8 bytes), so that the
//! same tensors give the same file. [`plan_shards`] splits a checkpoint into files named as
//! transformers' `save_pretrained` names them, balanced by bytes; [`index_json`] is the index
//! it writes beside them. [`check_shared`] refuses tensors that share memory, as safetensors
//! does.

use std::collections::{BTreeMap, HashSet};
use std::ops::Range;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::format::{self, Dtype, TensorInfo};
use crate::plan::target::dtype_of_torch;

/// Name of a checkpoint saved as one file.
pub const SINGLE_FILE: &str = "model.safetensors";
/// Name of the index of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// A tensor handed to a save: its name, dtype, shape on disk, and the index of its bytes in
/// the caller's list of sources.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SaveTensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub source: usize,
}

impl SaveTensor {
    /// A tensor as torch describes it: torch's dtype name ("bfloat16") and shape. torch holds
    /// two float4 values per element, safetensors counts values: the last dimension doubles.
    pub fn from_torch(name: &str, torch_dtype: &str, shape: &[i64], source: usize) -> Result<SaveTensor> {
        let refuse = |why: String| Error::SaveRefused { name: name.to_owned(), why };
        let dtype = dtype_of_torch(torch_dtype)
            .ok_or_else(|| refuse(format!("safetensors has no dtype for torch.{torch_dtype}")))?;
        let mut shape: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
        if dtype == Dtype::F4 {
            let last = shape
                .last_mut()
                .ok_or_else(|| refuse("a 0-d torch.float4_e2m1fn_x2 holds two values, which safetensors cannot describe: give it a dimension".into()))?;
            *last *= 2;
        }
        Ok(SaveTensor { name: name.to_owned(), dtype, shape, source })
    }

    pub fn nbytes(&self) -> Result<u64> {
        format::byte_len(&self.name, self.dtype, &self.shape)
            .map_err(|e| Error::SaveRefused { name: self.name.clone(), why: e.to_string() })
    }
}

/// One tensor's place in a file: the caller's source, the file offset, the byte count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placed {
    pub source: usize,
    pub offset: u64,
    pub nbytes: u64,
}

/// One file to write: the bytes that open it, then its tensors' bytes, in file order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileLayout {
    pub path: PathBuf,
    /// The 8-byte length and the header JSON.
    pub header: Vec<u8>,
    /// Sorted by offset, back to back from `header.len()` to `len`.
    pub tensors: Vec<Placed>,
    pub len: u64,
    /// Tensor names, in file order (for the index).
    pub names: Vec<String>,
}

/// Lays out one file as safetensors writes it.
pub fn plan_file(
    path: &Path,
    mut tensors: Vec<SaveTensor>,
    metadata: Option<&BTreeMap<String, String>>,
) -> Result<FileLayout> {
    check_names(&tensors)?;
    // safetensors' order: widest dtype first (so every tensor is aligned to its dtype), then
    // by name (bytewise), whatever order the caller's dict had.
    tensors.sort_by(|a, b| b.dtype.cmp(&a.dtype).then_with(|| a.name.cmp(&b.name)));
    let mut infos = Vec::with_capacity(tensors.len());
    let mut at = 0u64;
    for t in &tensors {
        let n = t.nbytes()?;
        infos.push(TensorInfo { name: t.name.clone(), dtype: t.dtype, shape: t.shape.clone(), begin: at, end: at + n });
        at += n;
    }
    let header = format::serialize_header(&infos, metadata);
    let start = header.len() as u64;
    let placed = tensors
        .iter()
        .zip(&infos)
        .map(|(t, i)| Placed { source: t.source, offset: start + i.begin, nbytes: i.nbytes() })
        .collect();
    Ok(FileLayout {
        path: path.to_owned(),
        header,
        tensors: placed,
        len: start + at,
        names: tensors.into_iter().map(|t| t.name).collect(),
    })
}

fn check_names(tensors: &[SaveTensor]) -> Result<()> {
    let mut seen = HashSet::with_capacity(tensors.len());
    for t in tensors {
        if t.name == "__metadata__" {
            return Err(Error::SaveRefused {
                name: t.name.clone(),
                why: "the name is reserved for the header's metadata".into(),
            });
        }
        if !seen.insert(t.name.as_str()) {
            return Err(Error::SaveRefused { name: t.name.clone(), why: "the name is given twice".into() });
        }
    }
    Ok(())
}

/// The memory a tensor spans: its device (-1 for host memory) and address range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub device: i64,
    pub begin: u64,
    pub end: u64,
}

/// Refuses tensors whose memory overlaps, as safetensors does: their bytes would be stored
/// twice and load back as separate tensors. Empty tensors span nothing.
pub fn check_shared(names: &[String], spans: &[Span]) -> Result<()> {
    let mut order: Vec<usize> = (0..spans.len()).filter(|&i| spans[i].end > spans[i].begin).collect();
    order.sort_by_key(|&i| (spans[i].device, spans[i].begin, spans[i].end));
    for pair in order.windows(2) {
        let (a, b) = (&spans[pair[0]], &spans[pair[1]]);
        if a.device == b.device && b.begin < a.end {
            let (first, second) = (&names[pair[0]], &names[pair[1]]);
            return Err(Error::SaveRefused {
                name: second.clone(),
                why: format!(
                    "it shares memory with tensor '{first}', and safetensors stores no shared tensors: save one of them, or a .clone() of the other"
                ),
            });
        }
    }
    Ok(())
}

/// Files of a sharded save: `model-00001-of-0000N.safetensors`, or `model.safetensors` alone.
pub fn shard_names(count: usize) -> Vec<String> {
    if count == 1 {
        return vec![SINGLE_FILE.to_owned()];
    }
    (1..=count).map(|i| format!("model-{i:05}-of-{count:05}.safetensors")).collect()
}

/// Splits tensors (their sizes, in the caller's order) into shards: the indices of each
/// shard's tensors. As transformers splits them, a tensor larger than `max_shard_size` is a
/// shard of its own, and the others fill shards in order, a new one when the next tensor would
/// pass the limit. That gives the number of shards; then the boundaries between the others move
/// so that their shards are as even in bytes as the order allows (every one still within the
/// limit): the same count, written in parallel by as many writers, finishes when the largest
/// one does. Shards are ordered by their first tensor.
pub fn plan_shards(sizes: &[u64], max_shard_size: u64) -> Vec<Vec<usize>> {
    let limit = max_shard_size.max(1);
    let (alone, packed): (Vec<usize>, Vec<usize>) = (0..sizes.len()).partition(|&i| sizes[i] > limit);
    let packed_sizes: Vec<u64> = packed.iter().map(|&i| sizes[i]).collect();
    let mut shards: Vec<Vec<usize>> = match packed.is_empty() {
        true => Vec::new(),
        false => {
            let count = greedy(&packed_sizes, limit).len();
            // The smallest cap that still gives `count` shards (greedy packing under a cap gives
            // the fewest shards for that cap): binary search up to the limit, which gives them.
            let (mut low, mut high) = (*packed_sizes.iter().max().unwrap(), limit);
            while low < high {
                let mid = low + (high - low) / 2;
                if greedy(&packed_sizes, mid).len() <= count {
                    high = mid;
                } else {
                    low = mid + 1;
                }
            }
            greedy(&packed_sizes, low).into_iter().map(|r| packed[r].to_vec()).collect()
        }
    };
    shards.extend(alone.into_iter().map(|i| vec![i]));
    if shards.is_empty() {
        shards.push(Vec::new());
    }
    shards.sort_by_key(|s| s.first().copied());
    shards
}

/// transformers' packing: fill a shard until the next tensor would pass `cap`.
fn greedy(sizes: &[u64], cap: u64) -> Vec<Range<usize>> {
    let mut shards = Vec::new();
    let (mut start, mut bytes) = (0, 0u64);
    for (i, &n) in sizes.iter().enumerate() {
        if i > start && bytes + n > cap {
            shards.push(start..i);
            (start, bytes) = (i, 0);
        }
        bytes += n;
    }
    shards.push(start..sizes.len());
    shards
}

/// The index transformers writes beside a sharded checkpoint, byte for byte: Python's
/// `json.dumps(index, indent=2, sort_keys=True) + "\n"`. serde_json's pretty output has the
/// same layout (maps sorted as BTreeMaps); Python's `ensure_ascii` then writes every
/// non-ASCII character as `\uXXXX` (UTF-16 units), which is valid wherever it occurs, as
/// only strings hold such characters.
pub fn index_json(total_size: u64, weight_map: &BTreeMap<String, String>) -> Vec<u8> {
    let metadata = BTreeMap::from([("total_size", total_size)]);
    let index = serde_json::json!({ "metadata": metadata, "weight_map": weight_map });
    let pretty = serde_json::to_string_pretty(&index).expect("JSON of strings and numbers always serializes");
    let mut out = String::with_capacity(pretty.len() + 1);
    for c in pretty.chars() {
        if c.is_ascii() {
            out.push(c);
        } else {
            for unit in c.encode_utf16(&mut [0; 2]) {
                out.push_str(&format!("\\u{unit:04x}"));
            }
        }
    }
    out.push('\n');
    out.into_bytes()
}

/// Where a save goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SaveTarget {
    /// One file, as `save_file` writes it.
    File(PathBuf),
    /// A checkpoint directory, in shards of at most this many bytes (a larger tensor alone).
    Directory { dir: PathBuf, max_shard_size: u64 },
    /// Files the caller lays out: each its tensors (indices into the save's list) and metadata.
    Files(Vec<FileSpec>),
}

/// One file of [`SaveTarget::Files`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileSpec {
    pub path: PathBuf,
    pub tensors: Vec<usize>,
    pub metadata: Option<BTreeMap<String, String>>,
}

/// Everything a save writes: its files, then the index (sharded saves only).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SavePlan {
    pub files: Vec<FileLayout>,
    pub index: Option<(PathBuf, Vec<u8>)>,
}

impl SavePlan {
    pub fn bytes(&self) -> u64 {
        self.files.iter().map(|f| f.len).sum()
    }
}

/// Plans a save of `tensors` (in the caller's order) to `target`.
pub fn plan_save(
    tensors: Vec<SaveTensor>,
    target: &SaveTarget,
    metadata: Option<&BTreeMap<String, String>>,
) -> Result<SavePlan> {
    let all = 0..tensors.len();
    plan_segments(tensors, std::slice::from_ref(&all), target, metadata)
}

/// Plans a save whose tensors come in `segments` (consecutive ranges of the list): a sharded
/// checkpoint's shards never hold tensors of two segments (in a group save, tensors the same
/// ranks hold), and each segment is sharded as [`plan_shards`] shards a whole save.
fn plan_segments(
    tensors: Vec<SaveTensor>,
    segments: &[Range<usize>],
    target: &SaveTarget,
    metadata: Option<&BTreeMap<String, String>>,
) -> Result<SavePlan> {
    check_names(&tensors)?;
    match target {
        SaveTarget::File(path) => Ok(SavePlan { files: vec![plan_file(path, tensors, metadata)?], index: None }),
        SaveTarget::Files(specs) => {
            let mut seen = vec![false; tensors.len()];
            let mut files = Vec::with_capacity(specs.len());
            for spec in specs {
                let mut members = Vec::with_capacity(spec.tensors.len());
                for &i in &spec.tensors {
                    match seen.get_mut(i) {
                        Some(seen) if !*seen => *seen = true,
                        _ => {
                            return Err(Error::InvalidArgument(format!(
                                "{}: tensor {i} is not one of the save's or is in two files",
                                spec.path.display()
                            )))
                        }
                    }
                    members.push(tensors[i].clone());
                }
                files.push(plan_file(&spec.path, members, spec.metadata.as_ref())?);
            }
            if let Some(i) = seen.iter().position(|s| !s) {
                return Err(Error::InvalidArgument(format!("tensor '{}' is in none of the files", tensors[i].name)));
            }
            Ok(SavePlan { files, index: None })
        }
        SaveTarget::Directory { dir, max_shard_size } => {
            let sizes = tensors.iter().map(SaveTensor::nbytes).collect::<Result<Vec<u64>>>()?;
            let mut shards: Vec<Vec<usize>> = Vec::new();
            for segment in segments.iter().filter(|s| !s.is_empty()) {
                let within = plan_shards(&sizes[segment.clone()], *max_shard_size);
                shards.extend(within.into_iter().map(|s| s.into_iter().map(|i| i + segment.start).collect()));
            }
            if shards.is_empty() {
                shards.push(Vec::new());
            }
            let names = shard_names(shards.len());
            let mut files = Vec::with_capacity(shards.len());
            for (members, name) in shards.iter().zip(&names) {
                let shard = members.iter().map(|&i| tensors[i].clone()).collect();
                files.push(plan_file(&dir.join(name), shard, metadata)?);
            }
            let index = (files.len() > 1).then(|| {
                let weight_map = files
                    .iter()
                    .zip(&names)
                    .flat_map(|(f, name)| f.names.iter().map(move |t| (t.clone(), name.clone())))
                    .collect();
                (dir.join(INDEX_FILE), index_json(sizes.iter().sum(), &weight_map))
            });
            Ok(SavePlan { files, index })
        }
    }
}

/// A tensor as one rank of a group describes it: torch's dtype name and its shape.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
pub struct RankTensor {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<i64>,
}

/// The tensors of a group save as one list: every name once, rank 0's in its order, then the
/// names only later ranks hold, grouped by the ranks that hold them (tensors the same ranks
/// hold are consecutive). A name on several ranks is one tensor, replicated: the same dtype
/// and shape on each (its bytes are taken to be the same).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupTensors {
    /// `source` of each: its index in this list.
    pub tensors: Vec<SaveTensor>,
    /// The ranks holding each tensor, ascending.
    pub holders: Vec<Vec<usize>>,
    /// Runs of tensors held by the same ranks.
    pub segments: Vec<Range<usize>>,
}

pub fn group_tensors(ranks: &[Vec<RankTensor>]) -> Result<GroupTensors> {
    let mut order: Vec<&RankTensor> = Vec::new();
    let mut holders: Vec<Vec<usize>> = Vec::new();
    let mut at: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    for (rank, tensors) in ranks.iter().enumerate() {
        let mut own = HashSet::with_capacity(tensors.len());
        for t in tensors {
            if !own.insert(t.name.as_str()) {
                return Err(Error::SaveRefused {
                    name: t.name.clone(),
                    why: format!("the name is given twice by rank {rank}"),
                });
            }
            match at.get(t.name.as_str()) {
                Some(&i) => {
                    let first = order[i];
                    if (first.dtype.as_str(), &first.shape) != (t.dtype.as_str(), &t.shape) {
                        return Err(Error::SaveRefused {
                            name: t.name.clone(),
                            why: format!(
                                "rank {} holds it as torch.{} {:?} and rank {rank} as torch.{} {:?}: a name several ranks hold is one tensor, replicated",
                                holders[i][0], first.dtype, first.shape, t.dtype, t.shape
                            ),
                        });
                    }
                    holders[i].push(rank);
                }
                None => {
                    at.insert(&t.name, order.len());
                    order.push(t);
                    holders.push(vec![rank]);
                }
            }
        }
    }
    // Tensors the same ranks hold together, in the order their first one came.
    let mut sets: Vec<&Vec<usize>> = Vec::new();
    for h in &holders {
        if !sets.contains(&h) {
            sets.push(h);
        }
    }
    let mut sorted: Vec<usize> = (0..order.len()).collect();
    sorted.sort_by_key(|&i| sets.iter().position(|s| *s == &holders[i]));
    let mut tensors = Vec::with_capacity(order.len());
    let mut segments: Vec<Range<usize>> = Vec::new();
    for (k, &i) in sorted.iter().enumerate() {
        let t = order[i];
        tensors.push(SaveTensor::from_torch(&t.name, &t.dtype, &t.shape, k)?);
        match segments.last_mut() {
            Some(last) if holders[sorted[last.start]] == holders[i] => last.end = k + 1,
            _ => segments.push(k..k + 1),
        }
    }
    let holders = sorted.iter().map(|&i| holders[i].clone()).collect();
    Ok(GroupTensors { tensors, holders, segments })
}

/// Plans a group's save: as [`plan_save`], but a checkpoint directory's shards keep tensors
/// held by different ranks apart (so that every shard has a rank holding all its bytes).
pub fn plan_group_save(
    group: &GroupTensors,
    target: &SaveTarget,
    metadata: Option<&BTreeMap<String, String>>,
) -> Result<SavePlan> {
    if let (SaveTarget::File(_) | SaveTarget::Files(_), [first, second, ..]) = (target, &group.segments[..]) {
        let (a, b) = (first.start, second.start);
        let path = match target {
            SaveTarget::File(path) => path.display().to_string(),
            _ => "the files".to_owned(),
        };
        return Err(Error::InvalidArgument(format!(
            "{path}: the ranks give different tensors ('{}' from ranks {:?}, '{}' from ranks {:?}), and a file of a group's save holds tensors every writing rank has: ranks holding different tensors save a checkpoint directory (save(..., process_group=...)), whose shards keep them apart",
            group.tensors[a].name, group.holders[a], group.tensors[b].name, group.holders[b]
        )));
    }
    plan_segments(group.tensors.clone(), &group.segments, target, metadata)
}

/// Bytes `start..end` of file `file` of a plan, which one rank writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteRange {
    pub file: usize,
    pub start: u64,
    pub end: u64,
}

/// The granularity of the ranges [`assign_ranges`] hands out (a multiple of any write
/// alignment).
pub const ASSIGN_UNIT: u64 = 1 << 20;

/// Splits the files' bytes among `world` ranks: each byte to exactly one rank, which holds
/// every tensor whose bytes share its unit (`unit` bytes at a multiple of `unit`), so that it
/// writes whole aligned units; the ranks able to write a run of units share it evenly, taking
/// into account what each writes already. Tensors held by all ranks are split into `world`
/// contiguous ranges (whole files where the sizes allow). Returns each rank's ranges, in file
/// order, adjacent ones merged.
pub fn assign_ranges(
    files: &[FileLayout],
    holders: &[Vec<usize>],
    world: usize,
    unit: u64,
) -> Result<Vec<Vec<WriteRange>>> {
    let everyone: Vec<usize> = (0..world).collect();
    // Every unit with the ranks that can write it.
    let mut units: Vec<(WriteRange, Vec<usize>)> = Vec::new();
    for (f, file) in files.iter().enumerate() {
        for k in 0..file.len.div_ceil(unit) {
            let (start, end) = (k * unit, ((k + 1) * unit).min(file.len));
            let first = file.tensors.partition_point(|t| t.offset + t.nbytes <= start);
            let mut writers = everyone.clone();
            let mut named: Option<usize> = None;
            let within = file.tensors[first..].iter().zip(&file.names[first..]).enumerate();
            for (k, (t, name)) in within.take_while(|(_, (t, _))| t.offset < end).filter(|(_, (t, _))| t.nbytes > 0) {
                let h = &holders[t.source];
                writers.retain(|r| h.contains(r));
                if writers.is_empty() {
                    let a = named.unwrap_or(first + k);
                    return Err(Error::InvalidArgument(format!(
                        "{}: tensors '{}' (held by ranks {:?}) and '{name}' (ranks {:?}) share a write unit that no rank holds whole: ranks holding different tensors save a checkpoint directory, whose shards keep them apart",
                        file.path.display(),
                        file.names[a],
                        holders[file.tensors[a].source],
                        h
                    )));
                }
                named.get_or_insert(first + k);
            }
            units.push((WriteRange { file: f, start, end }, writers));
        }
    }
    let mut loads = vec![0u64; world];
    let mut owner = vec![0usize; units.len()];
    let mut sets: Vec<Vec<usize>> = Vec::new();
    for (_, w) in &units {
        if !sets.contains(w) {
            sets.push(w.clone());
        }
    }
    // Sets of one rank first: what only it can write is its load before the shared ones.
    sets.sort_by_key(|s| s.len());
    for set in &sets {
        let mine: Vec<usize> = (0..units.len()).filter(|&u| &units[u].1 == set).collect();
        let bytes: Vec<u64> = mine.iter().map(|&u| units[u].0.end - units[u].0.start).collect();
        let share = water_fill(&set.iter().map(|&r| loads[r]).collect::<Vec<_>>(), bytes.iter().sum());
        // The units in order, each to the writer whose share its middle falls in.
        let mut bounds = Vec::with_capacity(set.len());
        let mut acc = 0u64;
        for s in &share {
            acc += s;
            bounds.push(acc);
        }
        let mut at = 0u64;
        for (&u, &n) in mine.iter().zip(&bytes) {
            let middle = at + n / 2;
            let k = bounds.iter().position(|&b| middle < b).unwrap_or(set.len() - 1);
            owner[u] = set[k];
            loads[set[k]] += n;
            at += n;
        }
    }
    let mut ranges: Vec<Vec<WriteRange>> = vec![Vec::new(); world];
    for ((range, _), &rank) in units.iter().zip(&owner) {
        match ranges[rank].last_mut() {
            Some(last) if last.file == range.file && last.end == range.start => last.end = range.end,
            _ => ranges[rank].push(*range),
        }
    }
    Ok(ranges)
}

/// How `total` bytes are best shared by writers that already write `loads`: the shares that
/// make the largest load the smallest (the least loaded filled up to a common level).
fn water_fill(loads: &[u64], total: u64) -> Vec<u64> {
    let mut order: Vec<usize> = (0..loads.len()).collect();
    order.sort_by_key(|&i| (loads[i], i));
    let mut level = 0u64;
    let mut k = 0;
    let mut below = 0u64;
    while k < order.len() {
        below += loads[order[k]];
        k += 1;
        level = (total + below).div_ceil(k as u64);
        if k == order.len() || level <= loads[order[k]] {
            break;
        }
    }
    let mut share = vec![0u64; loads.len()];
    let mut left = total;
    for &i in order.iter().take(k) {
        let s = level.saturating_sub(loads[i]).min(left);
        share[i] = s;
        left -= s;
    }
    share
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(name: &str, dtype: Dtype, shape: &[u64], source: usize) -> SaveTensor {
        SaveTensor { name: name.into(), dtype, shape: shape.to_vec(), source }
    }

    #[test]
    fn files_are_laid_out_as_safetensors_lays_them_out() {
        let tensors = vec![
            t("b", Dtype::BOOL, &[1], 0),
            t("s", Dtype::F32, &[], 1),
            t("e", Dtype::I64, &[0, 3], 2),
            t("a", Dtype::F32, &[2], 3),
        ];
        let layout = plan_file(Path::new("x.safetensors"), tensors, None).unwrap();
        assert_eq!(layout.names, ["e", "a", "s", "b"]);
        let json = r#"{"e":{"dtype":"I64","shape":[0,3],"data_offsets":[0,0]},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"s":{"dtype":"F32","shape":[],"data_offsets":[8,12]},"b":{"dtype":"BOOL","shape":[1],"data_offsets":[12,13]}}"#;
        let start = 8 + json.len().div_ceil(8) * 8;
        assert_eq!(&layout.header[8..8 + json.len()], json.as_bytes());
        assert_eq!(layout.header.len(), start);
        let s = start as u64;
        assert_eq!(
            layout.tensors,
            [
                Placed { source: 2, offset: s, nbytes: 0 },
                Placed { source: 3, offset: s, nbytes: 8 },
                Placed { source: 1, offset: s + 8, nbytes: 4 },
                Placed { source: 0, offset: s + 12, nbytes: 1 },
            ]
        );
        assert_eq!(layout.len, s + 13);
    }

    #[test]
    fn names_twice_or_reserved_are_refused() {
        let twice = vec![t("w", Dtype::F32, &[1], 0), t("w", Dtype::F16, &[1], 1)];
        let err = plan_file(Path::new("x"), twice, None).unwrap_err().to_string();
        assert_eq!(err, "tensor 'w' cannot be saved: the name is given twice");
        let reserved = vec![t("__metadata__", Dtype::F32, &[1], 0)];
        let err = plan_file(Path::new("x"), reserved, None).unwrap_err().to_string();
        assert!(err.contains("reserved"), "{err}");
    }

    #[test]
    fn torch_dtypes_map_to_safetensors_and_float4_counts_values() {
        let f4 = SaveTensor::from_torch("q", "float4_e2m1fn_x2", &[3, 2], 0).unwrap();
        assert_eq!((f4.dtype, f4.shape.as_slice(), f4.nbytes().unwrap()), (Dtype::F4, &[3, 4][..], 6));
        let err = SaveTensor::from_torch("c", "complex128", &[2], 0).unwrap_err().to_string();
        assert_eq!(err, "tensor 'c' cannot be saved: safetensors has no dtype for torch.complex128");
        assert!(SaveTensor::from_torch("z", "float4_e2m1fn_x2", &[], 0).is_err());
    }

    #[test]
    fn shared_memory_is_refused_and_neighbours_are_not() {
        let names: Vec<String> = ["a", "b", "c", "empty"].map(String::from).to_vec();
        let span = |device, begin, end| Span { device, begin, end };
        // Back to back, on two devices, and an empty tensor at a used address: all fine.
        check_shared(&names, &[span(-1, 0, 8), span(-1, 8, 16), span(0, 0, 8), span(-1, 4, 4)]).unwrap();
        let err = check_shared(&names, &[span(-1, 0, 8), span(-1, 100, 108), span(-1, 4, 12), span(-1, 0, 0)])
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("tensor 'c' cannot be saved: it shares memory with tensor 'a'"), "{err}");
    }

    fn ranges(shards: &[Vec<usize>]) -> Vec<Range<usize>> {
        shards.iter().map(|s| s[0]..s[s.len() - 1] + 1).collect()
    }

    #[test]
    fn shards_are_as_many_as_transformers_makes_and_even() {
        // transformers: [6,4] [6,3] [3,3,3] at 10.
        let sizes = [6, 4, 6, 3, 3, 3, 3];
        assert_eq!(greedy(&sizes, 10), [0..2, 2..4, 4..7]);
        assert_eq!(ranges(&plan_shards(&sizes, 10)), [0..2, 2..4, 4..7]);
        // Four equal tensors under a generous limit: one shard; under 2.5 of them: two of two.
        assert_eq!(plan_shards(&[5; 4], 100), [vec![0, 1, 2, 3]]);
        assert_eq!(ranges(&plan_shards(&[5; 4], 12)), [0..2, 2..4]);
        // Greedy at 9 packs [3,3,3] [1,1,1]; balanced keeps 2 shards but evens them: 6 and 6.
        let sizes = [3, 3, 3, 1, 1, 1];
        assert_eq!(greedy(&sizes, 9), [0..3, 3..6]);
        assert_eq!(ranges(&plan_shards(&sizes, 9)), [0..2, 2..6]);
        assert_eq!(plan_shards(&[], 10), [Vec::<usize>::new()]);
    }

    #[test]
    fn a_tensor_over_the_limit_is_alone_and_the_others_stay_within_it() {
        // As transformers: the big one alone, the others packed across it within the limit.
        for (sizes, expected) in [
            (vec![100, 100, 100, 100, 5000], vec![vec![0, 1], vec![2, 3], vec![4]]),
            (vec![5000, 100, 100, 100, 100], vec![vec![0], vec![1, 2], vec![3, 4]]),
            (vec![100, 5000, 100], vec![vec![0, 2], vec![1]]),
        ] {
            let shards = plan_shards(&sizes, 250);
            assert_eq!(shards, expected, "{sizes:?}");
            for s in shards.iter().filter(|s| s.len() > 1) {
                assert!(s.iter().map(|&i| sizes[i]).sum::<u64>() <= 250);
            }
        }
    }

    #[test]
    fn shard_names_are_transformers_names() {
        assert_eq!(shard_names(1), ["model.safetensors"]);
        assert_eq!(shard_names(2), ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]);
    }

    #[test]
    fn the_index_is_the_bytes_python_json_dumps_writes() {
        let map = BTreeMap::from([
            ("b.weight".to_string(), "model-00002-of-00002.safetensors".to_string()),
            ("a\u{e9}\u{1f600}\"".to_string(), "model-00001-of-00002.safetensors".to_string()),
        ]);
        // json.dumps({"metadata": {"total_size": 1234}, "weight_map": map}, indent=2, sort_keys=True) + "\n"
        let expected = "{\n  \"metadata\": {\n    \"total_size\": 1234\n  },\n  \"weight_map\": {\n    \"a\\u00e9\\ud83d\\ude00\\\"\": \"model-00001-of-00002.safetensors\",\n    \"b.weight\": \"model-00002-of-00002.safetensors\"\n  }\n}\n";
        assert_eq!(String::from_utf8(index_json(1234, &map)).unwrap(), expected);
    }

    #[test]
    fn a_directory_save_is_sharded_and_indexed() {
        let tensors: Vec<SaveTensor> = (0..4).map(|i| t(&format!("w{i}"), Dtype::U8, &[100], i)).collect();
        let dir = Path::new("/ckpt");
        let plan =
            plan_save(tensors.clone(), &SaveTarget::Directory { dir: dir.into(), max_shard_size: 250 }, None).unwrap();
        let paths: Vec<_> = plan.files.iter().map(|f| f.path.clone()).collect();
        assert_eq!(paths, [dir.join("model-00001-of-00002.safetensors"), dir.join("model-00002-of-00002.safetensors")]);
        let (index_path, index) = plan.index.unwrap();
        assert_eq!(index_path, dir.join(INDEX_FILE));
        let index: serde_json::Value = serde_json::from_slice(&index).unwrap();
        assert_eq!(index["metadata"]["total_size"], 400);
        assert_eq!(index["weight_map"]["w3"], "model-00002-of-00002.safetensors");
        let one = plan_save(tensors, &SaveTarget::Directory { dir: dir.into(), max_shard_size: 1000 }, None).unwrap();
        assert_eq!((one.files.len(), one.index), (1, None));
        assert_eq!(one.files[0].path, dir.join(SINGLE_FILE));
    }

    fn rank_tensor(name: &str, dtype: &str, shape: &[i64]) -> RankTensor {
        RankTensor { name: name.into(), dtype: dtype.into(), shape: shape.to_vec() }
    }

    #[test]
    fn a_group_s_tensors_are_its_ranks_names_once_grouped_by_holders() {
        let shared = rank_tensor("embed", "bfloat16", &[4, 8]);
        let ranks = vec![
            vec![rank_tensor("s0.a", "float32", &[3]), shared.clone()],
            vec![shared.clone(), rank_tensor("s1.a", "float16", &[5]), rank_tensor("s1.b", "uint8", &[7])],
            vec![shared.clone()],
        ];
        let group = group_tensors(&ranks).unwrap();
        let names: Vec<&str> = group.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["s0.a", "embed", "s1.a", "s1.b"]);
        assert_eq!(group.holders, [vec![0], vec![0, 1, 2], vec![1], vec![1]]);
        assert_eq!(group.segments, [0..1, 1..2, 2..4]);
        assert!(group.tensors.iter().enumerate().all(|(i, t)| t.source == i));

        let mut differs = ranks.clone();
        differs[2][0].shape = vec![8, 4];
        let err = group_tensors(&differs).unwrap_err().to_string();
        assert_eq!(
            err,
            "tensor 'embed' cannot be saved: rank 0 holds it as torch.bfloat16 [4, 8] and rank 2 as torch.bfloat16 [8, 4]: a name several ranks hold is one tensor, replicated"
        );
        let mut twice = ranks;
        twice[1].push(rank_tensor("s1.a", "float16", &[5]));
        assert!(group_tensors(&twice).unwrap_err().to_string().contains("given twice by rank 1"));
    }

    #[test]
    fn a_group_directory_keeps_each_holders_tensors_in_shards_of_their_own() {
        let ranks: Vec<Vec<RankTensor>> =
            (0..3).map(|r| (0..3).map(|i| rank_tensor(&format!("s{r}.{i}"), "uint8", &[100])).collect()).collect();
        let group = group_tensors(&ranks).unwrap();
        let target = SaveTarget::Directory { dir: "/ckpt".into(), max_shard_size: 1000 };
        let plan = plan_group_save(&group, &target, None).unwrap();
        // Each rank's 300 bytes would fit one shard; they are kept apart: 3 shards.
        let members: Vec<Vec<String>> = plan.files.iter().map(|f| f.names.clone()).collect();
        assert_eq!(members, [["s0.0", "s0.1", "s0.2"], ["s1.0", "s1.1", "s1.2"], ["s2.0", "s2.1", "s2.2"]]);
        assert!(plan.index.is_some());
        // One rank's group is the single-process plan.
        let one = group_tensors(&ranks[..1]).unwrap();
        let alone = plan_save(one.tensors.clone(), &target, None).unwrap();
        assert_eq!(plan_group_save(&one, &target, None).unwrap(), alone);
    }

    /// Every byte of every file in exactly one rank's ranges, units whole, ranges sorted.
    fn check_cover(files: &[FileLayout], ranges: &[Vec<WriteRange>], unit: u64) {
        for (f, file) in files.iter().enumerate() {
            let mut pieces: Vec<(u64, u64)> =
                ranges.iter().flatten().filter(|r| r.file == f).map(|r| (r.start, r.end)).collect();
            pieces.sort();
            let mut at = 0;
            for (start, end) in pieces {
                assert_eq!(start, at, "file {f}: a gap or an overlap at {at}");
                assert!(start % unit == 0 && (end % unit == 0 || end == file.len), "{start}..{end}");
                at = end;
            }
            assert_eq!(at, file.len, "file {f}");
        }
    }

    #[test]
    fn replicated_bytes_are_split_evenly_in_contiguous_ranges() {
        let tensors: Vec<SaveTensor> =
            (0..8).map(|i| t(&format!("w{i}"), Dtype::U8, &[1_000_000 + i as u64], i)).collect();
        let target = SaveTarget::Directory { dir: "/ckpt".into(), max_shard_size: 2_500_000 };
        let plan = plan_save(tensors, &target, None).unwrap();
        for world in 1..=5 {
            let holders = vec![(0..world).collect::<Vec<usize>>(); 8];
            let ranges = assign_ranges(&plan.files, &holders, world, 1 << 16).unwrap();
            check_cover(&plan.files, &ranges, 1 << 16);
            let loads: Vec<u64> = ranges.iter().map(|r| r.iter().map(|r| r.end - r.start).sum()).collect();
            let (min, max) = (loads.iter().min().unwrap(), loads.iter().max().unwrap());
            assert!(max - min <= 1 << 16, "{world} ranks: {loads:?}");
            // Contiguous: at most one range per file and rank, and a rank's ranges adjacent.
            for r in &ranges {
                for pair in r.windows(2) {
                    assert!(
                        pair[0].end == plan.files[pair[0].file].len
                            && pair[1].start == 0
                            && pair[1].file == pair[0].file + 1,
                        "{r:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn each_rank_writes_what_only_it_holds_and_a_share_of_the_rest() {
        // Rank 0 and 1 each hold 3 MB of their own; all three ranks hold 3 MB more.
        let mut ranks: Vec<Vec<RankTensor>> = vec![Vec::new(); 3];
        for (r, rank) in ranks.iter_mut().take(2).enumerate() {
            *rank = (0..3).map(|i| rank_tensor(&format!("s{r}.{i}"), "uint8", &[1 << 20])).collect();
        }
        for rank in ranks.iter_mut() {
            rank.extend((0..3).map(|i| rank_tensor(&format!("shared.{i}"), "uint8", &[1 << 20])));
        }
        let group = group_tensors(&ranks).unwrap();
        let plan = plan_group_save(&group, &SaveTarget::Directory { dir: "/c".into(), max_shard_size: 4 << 20 }, None)
            .unwrap();
        let ranges = assign_ranges(&plan.files, &group.holders, 3, ASSIGN_UNIT).unwrap();
        check_cover(&plan.files, &ranges, ASSIGN_UNIT);
        let loads: Vec<u64> = ranges.iter().map(|r| r.iter().map(|r| r.end - r.start).sum()).collect();
        // 9 MB and headers: rank 2 takes the shared ones, so every rank writes about 3 MB.
        let total: u64 = plan.bytes();
        assert_eq!(loads.iter().sum::<u64>(), total);
        for load in &loads {
            assert!(load.abs_diff(total / 3) <= ASSIGN_UNIT, "{loads:?}");
        }
        for (rank, r) in ranges.iter().enumerate() {
            for range in r {
                let file = &plan.files[range.file];
                for p in file.tensors.iter().filter(|p| p.offset < range.end && p.offset + p.nbytes > range.start) {
                    assert!(group.holders[p.source].contains(&rank), "rank {rank} writes a tensor it lacks");
                }
            }
        }
    }

    #[test]
    fn one_file_of_tensors_no_rank_holds_together_is_refused() {
        let ranks = vec![vec![rank_tensor("a", "uint8", &[10])], vec![rank_tensor("b", "uint8", &[10])]];
        let group = group_tensors(&ranks).unwrap();
        let err = plan_group_save(&group, &SaveTarget::File("/x.safetensors".into()), None).unwrap_err().to_string();
        assert!(err.starts_with("invalid argument: /x.safetensors: the ranks give different tensors ('a' from ranks [0], 'b' from ranks [1])"), "{err}");
        // Laid out together all the same, the unit they share has no writer.
        let plan = plan_save(group.tensors.clone(), &SaveTarget::File("/x.safetensors".into()), None).unwrap();
        let err = assign_ranges(&plan.files, &group.holders, 2, ASSIGN_UNIT).unwrap_err().to_string();
        assert!(err.contains("/x.safetensors: tensors 'a' (held by ranks [0]) and 'b' (ranks [1])"), "{err}");
        // One rank giving nothing is no difference: the others write it all.
        let ranks = vec![vec![rank_tensor("a", "uint8", &[10])], vec![]];
        let group = group_tensors(&ranks).unwrap();
        let plan = plan_group_save(&group, &SaveTarget::File("/x.safetensors".into()), None).unwrap();
        assert_eq!(assign_ranges(&plan.files, &group.holders, 2, ASSIGN_UNIT).unwrap()[1], []);
    }

    #[test]
    fn water_fill_levels_the_loads() {
        assert_eq!(water_fill(&[0, 0], 10), [5, 5]);
        assert_eq!(water_fill(&[8, 0], 10), [1, 9]);
        assert_eq!(water_fill(&[20, 0, 2], 10), [0, 6, 4]);
        assert_eq!(water_fill(&[0, 0, 0], 10).iter().sum::<u64>(), 10);
        assert_eq!(water_fill(&[3], 0), [0]);
    }
}
