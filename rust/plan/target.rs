//! Where a load goes and in what form: the target device, the `dtype=` cast, and what becomes
//! of each tensor once its bytes are in memory — a view of its buffer, a copy, or a cast.
//!
//! These are decisions, so they are made here; the C++ extension carries them out tensor by
//! tensor ([`Output`]) with ATen ops on the target device.

use std::path::Path;

use crate::error::{Error, Result};
use crate::format::Dtype;
use crate::plan::Placement;

/// The device types torch knows: a name among them that is not `cpu` or `cuda` is a device
/// this loader does not load to; any other name is not a device at all.
const TORCH_DEVICE_TYPES: &[&str] = &[
    "cpu",
    "cuda",
    "ipu",
    "xpu",
    "mkldnn",
    "opengl",
    "opencl",
    "ideep",
    "hip",
    "ve",
    "fpga",
    "maia",
    "xla",
    "lazy",
    "vulkan",
    "mps",
    "meta",
    "hpu",
    "mtia",
    "privateuseone",
];

/// The device a load targets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Cpu,
    /// A CUDA device; `None`: torch's current one.
    Cuda(Option<u32>),
}

impl Target {
    /// Parses torch's device syntax (`cpu`, `cuda`, `cuda:N`), refusing in one line what is not
    /// a device, a device other than CPU and CUDA, and a CPU other than the one.
    pub fn parse(device: &str) -> Result<Target> {
        let invalid = |why| Error::InvalidDevice { device: device.to_owned(), why };
        let not_a_device = || invalid(": not a device name (use 'cpu', 'cuda' or 'cuda:N')");
        let (kind, index) = match device.split_once(':') {
            None => (device, None),
            Some((kind, digits)) if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) => {
                (kind, Some(digits.parse::<u32>().map_err(|_| not_a_device())?))
            }
            Some(_) => return Err(not_a_device()),
        };
        match kind {
            // torch accepts "cpu:0"; there is one CPU device, and safetensors refuses "cpu:1" too.
            "cpu" if index.unwrap_or(0) == 0 => Ok(Target::Cpu),
            "cpu" => Err(invalid(": there is one CPU device, 'cpu'")),
            "cuda" => Ok(Target::Cuda(index)),
            k if TORCH_DEVICE_TYPES.contains(&k) => Err(invalid(" (only cpu and cuda)")),
            _ => Err(not_a_device()),
        }
    }

    /// The name torch gives the device (`cpu`, `cuda`, `cuda:1`).
    pub fn name(&self) -> String {
        match self {
            Target::Cpu => "cpu".to_owned(),
            Target::Cuda(None) => "cuda".to_owned(),
            Target::Cuda(Some(i)) => format!("cuda:{i}"),
        }
    }
}

/// Whether `dtype=` casts tensors of this dtype: full-precision floating point only.
/// Integers, bool, complex and quantised payloads (float8, float4, e8m0 scales) keep their
/// type: a cast to or from those without their scales turns weights into zeros and
/// saturated values.
pub fn castable(dtype: Dtype) -> bool {
    matches!(dtype, Dtype::F16 | Dtype::BF16 | Dtype::F32 | Dtype::F64)
}

/// torch's dtypes: `c10::ScalarType`'s number (fixed across releases: the stable ABI passes
/// dtypes by it), torch's name, and the safetensors dtype that holds it, if one does. The one
/// table between the two: the C++ layer asks here both ways.
const TORCH_DTYPES: [(i32, &str, Option<Dtype>); 22] = [
    (0, "uint8", Some(Dtype::U8)),
    (1, "int8", Some(Dtype::I8)),
    (2, "int16", Some(Dtype::I16)),
    (3, "int32", Some(Dtype::I32)),
    (4, "int64", Some(Dtype::I64)),
    (5, "float16", Some(Dtype::F16)),
    (6, "float32", Some(Dtype::F32)),
    (7, "float64", Some(Dtype::F64)),
    (8, "complex32", None),
    (9, "complex64", Some(Dtype::C64)),
    (10, "complex128", None),
    (11, "bool", Some(Dtype::BOOL)),
    (15, "bfloat16", Some(Dtype::BF16)),
    (23, "float8_e5m2", Some(Dtype::F8_E5M2)),
    (24, "float8_e4m3fn", Some(Dtype::F8_E4M3)),
    (25, "float8_e5m2fnuz", Some(Dtype::F8_E5M2FNUZ)),
    (26, "float8_e4m3fnuz", Some(Dtype::F8_E4M3FNUZ)),
    (27, "uint16", Some(Dtype::U16)),
    (28, "uint32", Some(Dtype::U32)),
    (29, "uint64", Some(Dtype::U64)),
    (44, "float8_e8m0fnu", Some(Dtype::F8_E8M0)),
    (45, "float4_e2m1fn_x2", Some(Dtype::F4)),
];

/// torch's name for ScalarType number `code` ("bfloat16"), or `dtype<code>` for one without a
/// name here (quantized and bit types: no safetensors dtype holds them).
pub fn torch_name(code: i32) -> String {
    TORCH_DTYPES.iter().find(|e| e.0 == code).map_or_else(|| format!("dtype{code}"), |e| e.1.to_owned())
}

/// The safetensors dtype of a torch dtype, by torch's name for it.
pub fn dtype_of_torch(name: &str) -> Option<Dtype> {
    TORCH_DTYPES.iter().find(|e| e.1 == name).and_then(|e| e.2)
}

/// The ScalarType number torch holds `dtype` as; None for FP6, which torch has no type for.
pub fn torch_code(dtype: Dtype) -> Option<i32> {
    TORCH_DTYPES.iter().find(|e| e.2 == Some(dtype)).map(|e| e.0)
}

/// The dtype `dtype=` names, by torch's name for it (`"bfloat16"`; `""` for no cast). A
/// target outside the castable set is refused.
pub fn cast_target(torch_name: &str) -> Result<Option<Dtype>> {
    match torch_name {
        "" => Ok(None),
        "float16" => Ok(Some(Dtype::F16)),
        "bfloat16" => Ok(Some(Dtype::BF16)),
        "float32" => Ok(Some(Dtype::F32)),
        "float64" => Ok(Some(Dtype::F64)),
        other => Err(Error::UnsupportedCast { dtype: format!("torch.{other}") }),
    }
}

/// Fails on a tensor torch cannot hold: a dtype it has no type for, an odd last dimension of
/// packed F4 (torch packs two values per element), a dimension beyond `i64`.
pub fn check_torch_can_hold(path: &Path, t: &Placement) -> Result<()> {
    let refuse = |why: String| Err(Error::Unrepresentable { path: path.to_owned(), name: t.name.clone(), why });
    if matches!(t.dtype, Dtype::F6_E2M3 | Dtype::F6_E3M2) {
        return refuse(format!("dtype {} has no torch equivalent", t.dtype.name()));
    }
    if t.dtype == Dtype::F4 && t.shape.last().is_none_or(|d| d % 2 != 0) {
        return refuse("F4 needs an even last dimension to load as torch.float4_e2m1fn_x2".to_owned());
    }
    if let Some(d) = t.shape.iter().find(|&&d| i64::try_from(d).is_err()) {
        return refuse(format!("dimension {d} does not fit in i64"));
    }
    Ok(())
}

/// The shape torch gives tensor `t`: packed F4 halves the last dimension.
pub fn torch_shape(t: &Placement) -> Vec<i64> {
    let mut shape: Vec<i64> = t.shape.iter().map(|&d| d as i64).collect();
    if t.dtype == Dtype::F4 {
        if let Some(last) = shape.last_mut() {
            *last /= 2;
        }
    }
    shape
}

/// What the extension does with one tensor once it has wrapped its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Output {
    /// Copy the bytes out of their buffer: they are misaligned for their type, or the buffer
    /// can be freed once its last views are gone.
    pub copy: bool,
    /// Cast to this dtype.
    pub cast: Option<Dtype>,
}

/// What becomes of each tensor: `buffers[i]` is the buffer tensor `i` lies in, `cast_to` what
/// `dtype=` asks for, and `freeable(b)` whether buffer `b` is memory of its own (not a
/// mapping of the page cache) that is freed once no tensor points into it.
///
/// A buffer is kept only while every tensor in it is still a view of it: once one of its
/// tensors is cast, the others are copied out too, so that the whole buffer is freed as soon
/// as the caller lets go, instead of staying alive for a few small uncast tensors beside the
/// cast copies.
pub fn outputs(
    tensors: &[Placement],
    buffers: &[usize],
    cast_to: Option<Dtype>,
    freeable: impl Fn(usize) -> bool,
) -> Vec<Output> {
    let casts: Vec<Option<Dtype>> =
        tensors.iter().map(|t| cast_to.filter(|&to| castable(t.dtype) && t.dtype != to)).collect();
    let mut has_cast = vec![false; buffers.iter().max().map_or(0, |&b| b + 1)];
    for (&b, cast) in buffers.iter().zip(&casts) {
        has_cast[b] |= cast.is_some();
    }
    tensors
        .iter()
        .zip(buffers)
        .zip(casts)
        .map(|((t, &b), cast)| {
            let view = t.nbytes > 0 && cast.is_none();
            Output { copy: !t.aligned || (view && has_cast[b] && freeable(b)), cast }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(dtype: Dtype, nbytes: u64, aligned: bool) -> Placement {
        Placement { name: "t".into(), dtype, shape: vec![nbytes], file: 0, offset: 0, nbytes, aligned }
    }

    #[test]
    fn devices_in_torch_syntax() {
        assert_eq!(Target::parse("cpu").unwrap(), Target::Cpu);
        assert_eq!(Target::parse("cpu:0").unwrap(), Target::Cpu);
        assert_eq!(Target::parse("cuda").unwrap(), Target::Cuda(None));
        assert_eq!(Target::parse("cuda:3").unwrap(), Target::Cuda(Some(3)));
        assert_eq!(Target::Cuda(Some(3)).name(), "cuda:3");
    }

    #[test]
    fn bad_devices_say_what_is_wrong() {
        let msg = |d: &str| Target::parse(d).unwrap_err().to_string();
        assert_eq!(msg("cpu:1"), "fastsafetensors: cannot load to device 'cpu:1': there is one CPU device, 'cpu'");
        assert_eq!(msg("mps"), "fastsafetensors: cannot load to device 'mps' (only cpu and cuda)");
        assert_eq!(msg("meta:0"), "fastsafetensors: cannot load to device 'meta:0' (only cpu and cuda)");
        for bad in ["gpu", "cuda:x", "cuda:-1", "cuda:", "cuda:+1", "", "CUDA", "cuda:99999999999"] {
            assert_eq!(
                msg(bad),
                format!(
                    "fastsafetensors: cannot load to device '{bad}': not a device name (use 'cpu', 'cuda' or 'cuda:N')"
                )
            );
        }
    }

    #[test]
    fn every_safetensors_dtype_torch_holds_has_one_scalar_type() {
        for d in Dtype::ALL {
            let code = torch_code(d);
            assert_eq!(code.is_none(), matches!(d, Dtype::F6_E2M3 | Dtype::F6_E3M2), "{d}");
            if let Some(code) = code {
                assert_eq!(dtype_of_torch(&torch_name(code)), Some(d));
            }
        }
        assert_eq!(torch_name(15), "bfloat16");
        assert_eq!(torch_name(12), "dtype12");
        assert_eq!(dtype_of_torch("complex128"), None);
    }

    #[test]
    fn only_full_precision_floats_are_cast_targets() {
        assert_eq!(cast_target("").unwrap(), None);
        assert_eq!(cast_target("bfloat16").unwrap(), Some(Dtype::BF16));
        let err = cast_target("int8").unwrap_err().to_string();
        assert!(err.starts_with("fastsafetensors: dtype=torch.int8 is not supported"), "{err}");
    }

    #[test]
    fn torch_cannot_hold_fp6_or_odd_fp4() {
        let path = Path::new("m.safetensors");
        let mut t = tensor(Dtype::F6_E2M3, 3, true);
        let err = check_torch_can_hold(path, &t).unwrap_err().to_string();
        assert_eq!(err, "m.safetensors: tensor 't': dtype F6_E2M3 has no torch equivalent");
        t.dtype = Dtype::F4;
        t.shape = vec![2, 3];
        assert!(check_torch_can_hold(path, &t).unwrap_err().to_string().contains("even last dimension"));
        t.shape = vec![2, 4];
        check_torch_can_hold(path, &t).unwrap();
        assert_eq!(torch_shape(&t), [2, 2]);
        t.dtype = Dtype::U8;
        t.shape = vec![u64::MAX];
        assert!(check_torch_can_hold(path, &t).unwrap_err().to_string().contains("does not fit in i64"));
    }

    #[test]
    fn without_a_cast_tensors_stay_views_unless_misaligned() {
        let ts = [tensor(Dtype::F32, 8, true), tensor(Dtype::F32, 8, false)];
        let out = outputs(&ts, &[0, 0], None, |_| true);
        assert_eq!(out, [Output { copy: false, cast: None }, Output { copy: true, cast: None }]);
    }

    #[test]
    fn a_cast_in_a_buffer_copies_its_other_views_out_where_that_frees_it() {
        // Buffer 0: a float cast and an int that stays; buffer 1: nothing cast.
        let ts = [
            tensor(Dtype::F32, 8, true),
            tensor(Dtype::I64, 8, true),
            tensor(Dtype::F16, 0, true),
            tensor(Dtype::I64, 8, true),
        ];
        let buffers = [0, 0, 0, 1];
        let out = outputs(&ts, &buffers, Some(Dtype::BF16), |_| true);
        assert_eq!(out[0], Output { copy: false, cast: Some(Dtype::BF16) });
        assert_eq!(out[1], Output { copy: true, cast: None }, "the int leaves the buffer");
        assert_eq!(out[2], Output { copy: false, cast: Some(Dtype::BF16) }, "empty: nothing to copy");
        assert_eq!(out[3], Output { copy: false, cast: None }, "nothing cast in buffer 1");
        // A mapping is page cache, not memory of the load's own: its views stay views.
        let mapped = outputs(&ts, &buffers, Some(Dtype::BF16), |_| false);
        assert_eq!(mapped[1], Output { copy: false, cast: None });
    }

    #[test]
    fn a_tensor_already_in_the_target_dtype_is_not_cast() {
        let ts = [tensor(Dtype::BF16, 8, true), tensor(Dtype::F8_E4M3, 8, true)];
        let out = outputs(&ts, &[0, 0], Some(Dtype::BF16), |_| true);
        assert_eq!(out, [Output { copy: false, cast: None }; 2]);
    }
}
