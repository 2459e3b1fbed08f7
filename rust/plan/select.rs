//! Selection: which tensors of a checkpoint a load reads, decided from the headers alone,
//! before any data is read.
//!
//! ```
//! use fastsafetensors::plan::select::{MatchMode, TensorFilter};
//! let last_layers = TensorFilter::new(MatchMode::Glob, &["model.layers.1[89].*", "lm_head.*"])?;
//! assert!(last_layers.matches("model.layers.19.mlp.up_proj.weight"));
//! assert!(!last_layers.matches("model.layers.9.mlp.up_proj.weight"));
//! # Ok::<(), fastsafetensors::Error>(())
//! ```
//!
//! Three ways to name tensors:
//! - [`MatchMode::Exact`]: the names themselves. A name that is in none of the files is an
//!   error (a typo would otherwise load a model with a weight silently missing).
//! - [`MatchMode::Glob`]: shell patterns matched against the whole name, as Python's
//!   `fnmatch.fnmatchcase` does: `*` any run of characters (dots included), `?` one
//!   character, `[abc]` / `[a-z]` one of a set, `[!abc]` one not in it.
//! - [`MatchMode::Regex`]: regular expressions (the `regex` crate's syntax, which runs in time
//!   linear in the name, whatever the pattern), found anywhere in the name as Python's
//!   `re.search` does; anchor with `^…$` to match the whole name.
//!
//! A glob or regex filter that matches nothing selects nothing: the load returns no tensors
//! and reads no data. Globs are translated to regular expressions, so one engine serves both.

use std::collections::HashSet;
use std::str::FromStr;

use regex::RegexSet;

use crate::error::{Error, Result};

/// How the patterns of a [`TensorFilter`] are matched against tensor names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MatchMode {
    Exact,
    #[default]
    Glob,
    Regex,
}

impl FromStr for MatchMode {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "exact" => Ok(MatchMode::Exact),
            "glob" => Ok(MatchMode::Glob),
            "regex" => Ok(MatchMode::Regex),
            other => Err(Error::InvalidArgument(format!(
                "unknown tensor_name_match_mode '{other}' (expected 'exact', 'glob' or 'regex')"
            ))),
        }
    }
}

/// A set of tensor names or patterns; a tensor is selected when any of them matches it.
#[derive(Debug, Clone)]
pub struct TensorFilter {
    mode: MatchMode,
    matcher: Matcher,
}

#[derive(Debug, Clone)]
enum Matcher {
    Names(HashSet<String>),
    Patterns(RegexSet),
}

impl TensorFilter {
    /// Compiles `patterns`. An invalid regular expression is an error naming it.
    pub fn new<S: AsRef<str>>(mode: MatchMode, patterns: &[S]) -> Result<TensorFilter> {
        let matcher = match mode {
            MatchMode::Exact => Matcher::Names(patterns.iter().map(|p| p.as_ref().to_owned()).collect()),
            MatchMode::Glob => {
                Matcher::Patterns(compile(patterns.iter().map(|p| glob_to_regex(p.as_ref())), patterns)?)
            }
            MatchMode::Regex => Matcher::Patterns(compile(patterns.iter().map(|p| p.as_ref().to_owned()), patterns)?),
        };
        Ok(TensorFilter { mode, matcher })
    }

    pub fn mode(&self) -> MatchMode {
        self.mode
    }

    pub fn matches(&self, name: &str) -> bool {
        match &self.matcher {
            Matcher::Names(names) => names.contains(name),
            Matcher::Patterns(set) => set.is_match(name),
        }
    }

    /// In exact mode, the names that are not among `present`, sorted; empty otherwise.
    pub fn missing<'a>(&self, present: impl IntoIterator<Item = &'a str>) -> Vec<String> {
        let Matcher::Names(names) = &self.matcher else { return Vec::new() };
        let present: HashSet<&str> = present.into_iter().collect();
        let mut missing: Vec<String> = names.iter().filter(|n| !present.contains(n.as_str())).cloned().collect();
        missing.sort();
        missing
    }
}

/// Rows `[start, stop)` of one tensor: the part of it a load reads (see
/// [`Placement::rows`](crate::plan::Placement::rows)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowRange {
    pub name: String,
    pub start: u64,
    pub stop: u64,
}

/// What a load reads: the tensors `filter` selects (every tensor without one), of which
/// those named in `rows` only in part.
#[derive(Debug, Clone, Default)]
pub struct Selection {
    pub filter: Option<TensorFilter>,
    pub rows: Vec<RowRange>,
}

impl Selection {
    pub fn all() -> Selection {
        Selection::default()
    }

    pub fn filtered(filter: TensorFilter) -> Selection {
        Selection { filter: Some(filter), rows: Vec::new() }
    }
}

fn compile<S: AsRef<str>>(regexes: impl Iterator<Item = String>, patterns: &[S]) -> Result<RegexSet> {
    let regexes: Vec<String> = regexes.collect();
    RegexSet::new(&regexes).map_err(|_| {
        // The set reports no index: find the first pattern that fails on its own.
        let (pattern, error) = regexes
            .iter()
            .zip(patterns)
            .find_map(|(r, p)| regex::Regex::new(r).err().map(|e| (p.as_ref().to_owned(), e)))
            .map_or_else(|| (String::new(), "too large".to_owned()), |(p, e)| (p, one_line(&e)));
        Error::InvalidArgument(format!("tensor_filter pattern '{pattern}' is not valid: {error}"))
    })
}

/// The regex crate's error in one line: its message spans several (the pattern, a caret under
/// the place, then `error: what`); keep what is wrong and where.
fn one_line(error: &regex::Error) -> String {
    let text = error.to_string();
    let what = text.lines().find_map(|l| l.trim().strip_prefix("error: ")).unwrap_or(text.trim());
    match text.lines().find_map(|l| l.trim_start().starts_with('^').then(|| l.find('^'))).flatten() {
        // The pattern line above the caret is indented as much as the caret's line.
        Some(caret) => {
            let indent = text.lines().nth(1).map_or(0, |l| l.len() - l.trim_start().len());
            format!("{what} (at character {})", caret.saturating_sub(indent) + 1)
        }
        None => what.to_owned(),
    }
}

/// The regular expression matching exactly the names the shell pattern `glob` matches, with
/// the rules of Python's `fnmatch.translate`: `*`, `?`, `[set]`, `[!set]`; an unclosed `[`
/// and every other character stand for themselves.
pub fn glob_to_regex(glob: &str) -> String {
    let chars: Vec<char> = glob.chars().collect();
    let mut out = String::from("(?s)^(?:");
    let mut i = 0;
    while i < chars.len() {
        match chars[i] {
            '*' => {
                out.push_str(".*");
                while i + 1 < chars.len() && chars[i + 1] == '*' {
                    i += 1;
                }
            }
            '?' => out.push('.'),
            '[' => match class_end(&chars, i + 1) {
                Some(end) => {
                    out.push_str(&class(&chars[i + 1..end]));
                    i = end;
                }
                None => out.push_str(r"\["),
            },
            c => out.push_str(&regex::escape(c.encode_utf8(&mut [0; 4]))),
        }
        i += 1;
    }
    out.push_str(")$");
    out
}

/// Index of the `]` closing a set whose contents start at `start` (after the `[`). A `!`
/// right after the `[`, then a `]` right after that, belong to the set.
fn class_end(chars: &[char], start: usize) -> Option<usize> {
    let mut j = start;
    if chars.get(j) == Some(&'!') {
        j += 1;
    }
    if chars.get(j) == Some(&']') {
        j += 1;
    }
    (j..chars.len()).find(|&k| chars[k] == ']')
}

/// The regex class for the contents of a glob set (without its brackets). Every member is
/// escaped, so that nothing in it can read as the regex crate's set operators (`&&`, `--`,
/// `~~`) or a nested class. Ranges running backwards are empty, as in fnmatch.
fn class(contents: &[char]) -> String {
    let (negated, contents) = match contents.first() {
        Some('!') => (true, &contents[1..]),
        _ => (false, contents),
    };
    let escape = |c: char| regex::escape(c.encode_utf8(&mut [0; 4]));
    let mut members = String::new();
    let mut k = 0;
    while k < contents.len() {
        if k + 2 < contents.len() && contents[k + 1] == '-' {
            let (lo, hi) = (contents[k], contents[k + 2]);
            if lo <= hi {
                members.push_str(&format!("{}-{}", escape(lo), escape(hi)));
            }
            k += 3;
        } else {
            members.push_str(&escape(contents[k]));
            k += 1;
        }
    }
    match (members.is_empty(), negated) {
        (true, false) => "[^\\s\\S]".to_owned(), // an empty set matches no character
        (true, true) => ".".to_owned(),
        (false, false) => format!("[{members}]"),
        (false, true) => format!("[^{members}]"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn glob(pattern: &str, name: &str) -> bool {
        TensorFilter::new(MatchMode::Glob, &[pattern]).unwrap().matches(name)
    }

    #[test]
    fn glob_star_crosses_dots_and_matches_the_whole_name() {
        assert!(glob("model.layers.*.mlp.*", "model.layers.3.mlp.up_proj.weight"));
        assert!(glob("*", ""));
        assert!(glob("*bias", "a.b.bias"));
        assert!(!glob("*bias", "a.bias.x"), "a glob matches the whole name");
        assert!(!glob("layers.1", "layers.10"));
        assert!(glob("a**b", "a.x.b"));
    }

    #[test]
    fn glob_question_mark_is_one_character() {
        assert!(glob("layers.?.w", "layers.7.w"));
        assert!(!glob("layers.?.w", "layers.17.w"));
        assert!(glob("é?", "éü"), "characters, not bytes");
    }

    #[test]
    fn glob_sets_ranges_and_negation() {
        assert!(glob("layers.1[89].*", "layers.18.q"));
        assert!(!glob("layers.1[89].*", "layers.17.q"));
        assert!(glob("x[0-3]", "x2") && !glob("x[0-3]", "x4"));
        assert!(glob("x[!0-3]", "x4") && !glob("x[!0-3]", "x2"));
        assert!(glob("x[]]", "x]"), "a ] first in the set is a member");
        assert!(glob("x[!]]", "xa") && !glob("x[!]]", "x]"));
        assert!(glob("x[a-]", "x-"), "a trailing - is a member");
        assert!(!glob("x[z-a]", "xm") && !glob("x[z-a]", "xz"), "a backwards range is empty");
        assert!(glob("x[!z-a]", "xm"));
    }

    #[test]
    fn glob_treats_regex_syntax_and_unclosed_sets_literally() {
        assert!(glob("a.b", "a.b") && !glob("a.b", "axb"));
        assert!(glob("w(1)+$^|{2}", "w(1)+$^|{2}"));
        assert!(glob("x[", "x[") && glob("x[ab", "x[ab"));
        assert!(glob(r"a\b", r"a\b"), "a backslash is an ordinary character in a glob");
        assert!(glob("[&&]x", "&x") && glob("[a--b]", "b"), "no regex set operators inside a set");
        assert!(!glob("[a--b]", "-"), "a backwards range a--, then b");
        assert!(glob("[a-c-e]", "-") && !glob("[a-c-e]", "d"), "a range, then - and e");
        assert!(glob("[~~]", "~") && glob("[[]", "["));
    }

    #[test]
    fn regex_mode_searches_and_anchors_on_request() {
        let f = TensorFilter::new(MatchMode::Regex, &[r"layers\.(18|19)\."]).unwrap();
        assert!(f.matches("model.layers.18.mlp.w") && !f.matches("model.layers.8.mlp.w"));
        let anchored = TensorFilter::new(MatchMode::Regex, &["^lm_head$"]).unwrap();
        assert!(anchored.matches("lm_head") && !anchored.matches("lm_head.weight"));
    }

    #[test]
    fn any_pattern_selects() {
        let f = TensorFilter::new(MatchMode::Glob, &["a.*", "b"]).unwrap();
        assert!(f.matches("a.x") && f.matches("b") && !f.matches("c"));
        assert!(!TensorFilter::new::<&str>(MatchMode::Glob, &[]).unwrap().matches("a"), "no pattern, no match");
    }

    #[test]
    fn exact_mode_compares_names_and_reports_missing_ones() {
        let f = TensorFilter::new(MatchMode::Exact, &["b", "a.*", "z", "y"]).unwrap();
        assert!(f.matches("a.*") && !f.matches("a.x"), "exact names are not patterns");
        assert_eq!(f.missing(["a.*", "b", "c"]), ["y", "z"]);
        assert!(TensorFilter::new(MatchMode::Glob, &["nothing"]).unwrap().missing(["a"]).is_empty());
    }

    #[test]
    fn invalid_regex_names_the_pattern() {
        let err = TensorFilter::new(MatchMode::Regex, &["ok", "bad("]).unwrap_err().to_string();
        assert_eq!(err, "invalid argument: tensor_filter pattern 'bad(' is not valid: unclosed group (at character 4)");
        let err = TensorFilter::new(MatchMode::Regex, &[r"w\.[z-a]"]).unwrap_err().to_string();
        assert!(
            err.ends_with("is not valid: invalid character class range, the start must be <= the end (at character 5)"),
            "{err}"
        );
    }

    #[test]
    fn modes_parse() {
        assert_eq!("exact".parse::<MatchMode>().unwrap(), MatchMode::Exact);
        assert_eq!("glob".parse::<MatchMode>().unwrap(), MatchMode::Glob);
        assert_eq!("regex".parse::<MatchMode>().unwrap(), MatchMode::Regex);
        let err = "fnmatch".parse::<MatchMode>().unwrap_err().to_string();
        assert!(err.contains("'fnmatch'") && err.contains("'exact', 'glob' or 'regex'"), "{err}");
    }
}
