//! The AWS CLI's shared files, `~/.aws/credentials` and `~/.aws/config`, read for the profile
//! the environment names, so that a machine set up with `aws configure` needs nothing more.
//!
//! What the CLI reads is read the same way: the profile is `$AWS_PROFILE` (else
//! `$AWS_DEFAULT_PROFILE`, else `default`); the files are `$AWS_SHARED_CREDENTIALS_FILE` and
//! `$AWS_CONFIG_FILE` where set; the credentials file's sections are profile names, the config
//! file's are `default` and `profile NAME`; a key in the credentials file wins over the same key
//! in the config file. Variables win over both: a file's value is used only where the
//! environment gives none (the caller decides that).
//!
//! Profiles that get their credentials by running something (`credential_process`, SSO,
//! `role_arn`) are refused with what to do instead rather than passed over: passing over them
//! would send the client to the instance metadata service, which off the cloud answers only
//! after its timeouts, and then with the wrong error. Errors never quote a line of these files:
//! it may hold a secret.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The keys of a profile this loader uses.
#[derive(Debug, Default, Clone, PartialEq, Eq, Hash)]
pub struct Profile {
    pub access_key_id: Option<String>,
    pub secret_access_key: Option<String>,
    pub session_token: Option<String>,
    pub region: Option<String>,
    pub endpoint_url: Option<String>,
}

/// Keys through which a profile gets credentials by other means than stating them.
const INDIRECT_CREDENTIALS: &[&str] =
    &["credential_process", "sso_session", "sso_start_url", "role_arn", "web_identity_token_file"];

/// One file's sections: section name → (key → value).
type Sections = HashMap<String, HashMap<String, String>>;

/// The profile the environment names, from the files the environment names: `Ok(None)` where
/// neither file has it and it was not asked for by name; `Err` (one line, naming the file or
/// the profile) where a file cannot be parsed, a named profile is in neither, or the profile
/// gets its credentials indirectly.
pub fn profile_from_env() -> Result<Option<Profile>, String> {
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let named = var("AWS_PROFILE").or_else(|| var("AWS_DEFAULT_PROFILE"));
    let home = var("HOME").map(PathBuf::from);
    let file = |env: &str, name: &str| {
        var(env).map(PathBuf::from).or_else(|| home.as_ref().map(|h| h.join(".aws").join(name)))
    };
    let credentials = file("AWS_SHARED_CREDENTIALS_FILE", "credentials");
    let config = file("AWS_CONFIG_FILE", "config");
    let read = |path: &Option<PathBuf>| -> Result<Sections, String> {
        match path {
            Some(path) => match std::fs::read_to_string(path) {
                Ok(text) => parse(&text).map_err(|(line, why)| format!("{}, line {line}: {why}", path.display())),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Sections::new()),
                Err(e) => Err(format!("{}: {e}", path.display())),
            },
            None => Ok(Sections::new()),
        }
    };
    let name = named.clone().unwrap_or_else(|| "default".to_owned());
    let found = select(&read(&credentials)?, &read(&config)?, &name);
    match found {
        None if named.is_some() => {
            Err(format!("AWS_PROFILE={name}: no such profile in {} or {}", shown(&credentials), shown(&config)))
        }
        None => Ok(None),
        Some(values) => profile_of(&name, &values).map(Some),
    }
}

fn shown(path: &Option<PathBuf>) -> String {
    path.as_deref().map_or_else(|| "~/.aws (HOME is not set)".to_owned(), |p: &Path| p.display().to_string())
}

/// The profile's keys, the credentials file's over the config file's.
fn select(credentials: &Sections, config: &Sections, name: &str) -> Option<HashMap<String, String>> {
    let in_config = if name == "default" {
        config.get("default")
    } else {
        config.get(&format!("profile {name}")).or_else(|| config.get(name))
    };
    let in_credentials = credentials.get(name);
    if in_config.is_none() && in_credentials.is_none() {
        return None;
    }
    let mut values = in_config.cloned().unwrap_or_default();
    values.extend(in_credentials.cloned().unwrap_or_default());
    Some(values)
}

fn profile_of(name: &str, values: &HashMap<String, String>) -> Result<Profile, String> {
    let get = |k: &str| values.get(k).filter(|v| !v.is_empty()).cloned();
    let profile = Profile {
        access_key_id: get("aws_access_key_id"),
        secret_access_key: get("aws_secret_access_key"),
        session_token: get("aws_session_token"),
        region: get("region"),
        endpoint_url: get("endpoint_url"),
    };
    if profile.access_key_id.is_none() {
        if let Some(key) = INDIRECT_CREDENTIALS.iter().find(|k| values.contains_key(**k)) {
            return Err(format!(
                "the AWS profile '{name}' gets its credentials through {key}, which this loader does not \
                 follow: export them first (eval \"$(aws configure export-credentials --profile {name} --format env)\")"
            ));
        }
    }
    if profile.access_key_id.is_some() != profile.secret_access_key.is_some() {
        return Err(format!("the AWS profile '{name}' has only one of aws_access_key_id and aws_secret_access_key"));
    }
    Ok(profile)
}

/// The INI dialect of the AWS files: `[section]` lines, `key = value` lines, `#` and `;`
/// comments, and indented lines, which continue the key before them (the CLI's nested
/// `s3 =` settings): those are skipped, as settings of one service only. An error is
/// (line number, why), never the line itself.
fn parse(text: &str) -> Result<Sections, (usize, &'static str)> {
    let mut sections = Sections::new();
    let mut current: Option<String> = None;
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim_end();
        let trimmed = line.trim_start();
        if trimmed.is_empty() || trimmed.starts_with('#') || trimmed.starts_with(';') {
            continue;
        }
        if line.starts_with([' ', '\t']) {
            if current.is_none() {
                return Err((i + 1, "an indented line before any [section]"));
            }
            continue;
        }
        if let Some(rest) = line.strip_prefix('[') {
            let Some(name) = rest.strip_suffix(']') else {
                return Err((i + 1, "a [section] line without its closing ]"));
            };
            let name = name.split_whitespace().collect::<Vec<_>>().join(" ");
            sections.entry(name.clone()).or_default();
            current = Some(name);
            continue;
        }
        let Some((key, value)) = line.split_once('=') else {
            return Err((i + 1, "neither a [section] nor a key = value line"));
        };
        let Some(section) = &current else {
            return Err((i + 1, "a key = value line before any [section]"));
        };
        let key = key.trim().to_ascii_lowercase();
        if key.is_empty() {
            return Err((i + 1, "a line with no key before its ="));
        }
        sections.get_mut(section).expect("entered above").insert(key, value.trim().to_owned());
    }
    Ok(sections)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CREDENTIALS: &str = "\
# written by aws configure
[default]
aws_access_key_id = AKIDEFAULT
aws_secret_access_key = secret/default

[garage]
aws_access_key_id=GK123
aws_secret_access_key =  s3cr3t=with=equals
aws_session_token = tok
";

    const CONFIG: &str = "\
[default]
region = eu-west-1

[profile garage]
region = garage
endpoint_url = http://127.0.0.1:3900
s3 =
  addressing_style = path
; a comment
[profile assumed]
role_arn = arn:aws:iam::123:role/x
source_profile = default

[profile sso]
sso_session = corp

[profile half]
aws_access_key_id = AKIHALF
";

    fn profile(name: &str) -> Result<Option<Profile>, String> {
        let (credentials, config) = (parse(CREDENTIALS).unwrap(), parse(CONFIG).unwrap());
        select(&credentials, &config, name).map(|v| profile_of(name, &v)).transpose()
    }

    #[test]
    fn the_default_profile_joins_both_files() {
        let p = profile("default").unwrap().unwrap();
        assert_eq!(p.access_key_id.as_deref(), Some("AKIDEFAULT"));
        assert_eq!(p.secret_access_key.as_deref(), Some("secret/default"));
        assert_eq!(p.region.as_deref(), Some("eu-west-1"));
        assert_eq!(p.endpoint_url, None);
    }

    #[test]
    fn a_named_profile_is_a_profile_section_in_the_config_file() {
        let p = profile("garage").unwrap().unwrap();
        assert_eq!(p.access_key_id.as_deref(), Some("GK123"));
        assert_eq!(p.secret_access_key.as_deref(), Some("s3cr3t=with=equals"));
        assert_eq!(p.session_token.as_deref(), Some("tok"));
        assert_eq!(p.region.as_deref(), Some("garage"));
        assert_eq!(p.endpoint_url.as_deref(), Some("http://127.0.0.1:3900"));
    }

    #[test]
    fn the_credentials_file_wins() {
        let credentials = parse("[p]\naws_access_key_id = A\naws_secret_access_key = B\n").unwrap();
        let config = parse("[profile p]\naws_access_key_id = X\naws_secret_access_key = Y\nregion = r\n").unwrap();
        let p = profile_of("p", &select(&credentials, &config, "p").unwrap()).unwrap();
        assert_eq!((p.access_key_id.as_deref(), p.region.as_deref()), (Some("A"), Some("r")));
    }

    #[test]
    fn indirect_credentials_are_refused_with_what_to_do() {
        for (name, key) in [("assumed", "role_arn"), ("sso", "sso_session")] {
            let e = profile(name).unwrap_err();
            assert!(e.contains(&format!("'{name}'")) && e.contains(key), "{e}");
            assert!(e.contains("export-credentials"), "{e}");
        }
        assert!(profile("half").unwrap_err().contains("only one of"));
        assert_eq!(profile("absent"), Ok(None));
    }

    #[test]
    fn malformed_lines_are_located_without_being_quoted() {
        for (text, line, why) in [
            ("[a]\naws_secret_access_key SECRET\n", 2, "neither"),
            ("key = v\n", 1, "before any [section]"),
            ("[a\n", 1, "closing ]"),
            ("  x = y\n", 1, "indented"),
            ("[a]\n= v\n", 2, "no key"),
        ] {
            let (at, message) = parse(text).unwrap_err();
            assert_eq!(at, line, "{text:?}");
            assert!(message.contains(why), "{message}");
            assert!(!message.contains("SECRET"));
        }
        // Comments, blank lines and nested settings are not errors.
        assert!(parse("# c\n; c\n\n[s]\nk = v\nsub =\n  nested = 1\n").is_ok());
    }
}
