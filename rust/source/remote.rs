//! Objects in S3, Google Cloud Storage, Azure Blob Storage or behind an HTTP(S) URL with range
//! support, read through Apache Arrow's `object_store`.
//!
//! A [`RemoteObject`] is opened with one ranged GET of its first [`SPECULATIVE_HEADER`] bytes:
//! that fixes its size and version (ETag, and the version id or generation where the store has
//! one) and usually holds the whole header. Every later read is split into parts of
//! `$FASTSAFETENSORS_REMOTE_PART_SIZE` bytes fetched by parallel ranged GETs (as many in flight
//! to each server as make the reads faster, up to 64, or `$FASTSAFETENSORS_REMOTE_CONCURRENCY`
//! where it is set: [`super::in_flight`]), each conditional on that
//! version: an object replaced mid-load fails the load ([`Error::RemoteChanged`]) instead of
//! mixing two versions' bytes. The parts land straight in the buffer the caller gives (the
//! page-aligned host buffers, or the pinned staging slots of a device load).
//!
//! Credentials, endpoint and region come from the environment, as the builders' `from_env`
//! read it (`AWS_ACCESS_KEY_ID`, `AWS_ENDPOINT_URL`, `AWS_REGION`, `AWS_SKIP_SIGNATURE`,
//! `GOOGLE_SERVICE_ACCOUNT`, `AZURE_STORAGE_ACCOUNT_NAME`, ...), and for S3 from the AWS CLI's
//! files where no variable says ([`aws_files`]). A plain `http://` endpoint is
//! allowed without `AWS_ALLOW_HTTP`: it is what a local server has. Requests are retried with
//! backoff on 5xx, throttling and connection errors, within bounded timeouts, so that nothing
//! hangs. Errors name the URL (its query string left out: it may hold a signature) and never
//! a credential.
//!
//! The requests run on one small multi-threaded tokio runtime owned by this module, built at
//! the first remote read; callers (the I/O pool's threads) block on it.

use std::collections::HashMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use futures::stream::{self, StreamExt, TryStreamExt};
use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::azure::{AzureConfigKey, MicrosoftAzureBuilder};
use object_store::gcp::{GoogleCloudStorageBuilder, GoogleConfigKey};
use object_store::http::HttpBuilder;
use object_store::path::Path as ObjectPath;
use object_store::{
    Attribute, BackoffConfig, ClientConfigKey, ClientOptions, GetOptions, ObjectStore, ObjectStoreScheme, RetryConfig,
};
use tokio::runtime::Runtime;
use url::Url;

use super::aws_files;
use super::cache::CacheWriter;
use super::in_flight::InFlight;
use super::{sampled_fingerprint, Capabilities, Identity, LocalFile, Source};
use crate::error::{shown, Error, Result};
use crate::format::{self, Header};
use crate::settings::setting;
use crate::source;
use crate::source::budget::parse_size;

/// Bytes asked for by the first GET of an object: enough for the header of nearly every
/// checkpoint (a 1,000-tensor header is ~100 KB), so that opening a file costs one request.
pub const SPECULATIVE_HEADER: u64 = 1 << 20;
/// Environment variable: bytes per ranged GET.
pub const PART_SIZE_ENV: &str = "FASTSAFETENSORS_REMOTE_PART_SIZE";
/// Environment variable: ranged GETs in flight at once to one server (host and port); unset,
/// the number is found while reading ([`super::in_flight`]).
pub const CONCURRENCY_ENV: &str = "FASTSAFETENSORS_REMOTE_CONCURRENCY";
/// Environment variable: seconds one request may take (connecting, and each part's transfer).
pub const TIMEOUT_ENV: &str = "FASTSAFETENSORS_REMOTE_TIMEOUT";
/// Environment variable: how many times a failed request is retried.
pub const RETRIES_ENV: &str = "FASTSAFETENSORS_REMOTE_RETRIES";
/// 8 MiB parts: what parallel curl needs to saturate a local S3 server (1.1 GB/s with 4-16
/// streams of 8 MiB ranges, measured on the development VM).
const DEFAULT_PART_SIZE: u64 = 8 << 20;
const DEFAULT_TIMEOUT_S: u64 = 30;
const DEFAULT_RETRIES: usize = 10;
/// Retries of one request stop this long after it was first sent.
const RETRY_WINDOW: Duration = Duration::from_secs(120);
/// The wait before the first retry of a request, doubled before each next one up to the most.
const FIRST_RETRY_GAP: Duration = Duration::from_millis(100);
const MAX_RETRY_GAP: Duration = Duration::from_secs(8);
/// How often a read waiting on the store checks whether it was cancelled.
const CANCEL_CHECK: Duration = Duration::from_millis(50);
/// Largest object read whole (an index): bigger ones are not indexes.
const MAX_SMALL_OBJECT: u64 = 100_000_000;
/// URL schemes read through `object_store`.
const SCHEMES: &[&str] = &["s3", "s3a", "gs", "az", "adl", "azure", "abfs", "abfss", "http", "https"];

/// How remote reads are made, from the environment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteSettings {
    pub part_size: u64,
    /// GETs in flight to one server, if pinned.
    pub concurrency: Option<usize>,
    pub timeout: Duration,
    pub retries: usize,
}

impl RemoteSettings {
    /// The settings the environment gives, each malformed one an error naming it.
    pub fn from_env() -> Result<RemoteSettings> {
        let part = |v: &str| parse_size(v).flatten().filter(|n| (64 << 10..=1 << 30).contains(n));
        let count = |lo: usize, hi: usize| move |v: &str| v.parse::<usize>().ok().filter(|n| (lo..=hi).contains(n));
        Ok(RemoteSettings {
            part_size: setting(PART_SIZE_ENV, "a size from 64K to 1G (e.g. 8M)", part)?.unwrap_or(DEFAULT_PART_SIZE),
            concurrency: setting(CONCURRENCY_ENV, "a whole number from 1 to 1024", count(1, 1024))?,
            timeout: Duration::from_secs(
                setting(TIMEOUT_ENV, "a whole number of seconds from 1 to 3600", |v| {
                    v.parse::<u64>().ok().filter(|n| (1..=3600).contains(n))
                })?
                .unwrap_or(DEFAULT_TIMEOUT_S),
            ),
            retries: setting(RETRIES_ENV, "a whole number from 0 to 100", count(0, 100))?.unwrap_or(DEFAULT_RETRIES),
        })
    }
}

/// Whether `path` is a URL this module reads (`s3://`, `gs://`, `az://`, `http(s)://`, ...).
pub fn is_url(path: &Path) -> bool {
    path.to_str().is_some_and(|s| s.split_once("://").is_some_and(|(scheme, _)| SCHEMES.contains(&scheme)))
}

/// The runtime the requests run on: built once, a worker thread per core (2 to 8): they
/// receive the bytes and copy them into place, and more workers than cores only add switches.
fn runtime() -> Result<&'static Runtime> {
    static RUNTIME: OnceLock<std::result::Result<Runtime, String>> = OnceLock::new();
    RUNTIME
        .get_or_init(|| {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 8)))
                .thread_name("fastsafetensors-remote")
                .enable_all()
                .build()
                .map_err(|e| e.to_string())
        })
        .as_ref()
        .map_err(|e| Error::io("remote I/O runtime", "start", std::io::Error::other(e.clone())))
}

/// Runs `fut` to completion on the runtime, from a thread that is not one of its own.
fn block_on<T>(fut: impl Future<Output = Result<T>>) -> Result<T> {
    runtime()?.block_on(fut)
}

/// The GETs in flight to the server at `host` (`scheme://authority`): pinned by the settings,
/// or found while reading. One per host (and pinned number), so that a server that stalls holds
/// only its own requests' slots: loads from other servers go on.
fn in_flight(host: &str, pinned: Option<usize>) -> Arc<InFlight> {
    type Servers = HashMap<(String, Option<usize>), Arc<InFlight>>;
    static LIMITS: OnceLock<Mutex<Servers>> = OnceLock::new();
    let mut limits = LIMITS.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
    let limit = limits.entry((host.to_owned(), pinned)).or_insert_with(|| {
        Arc::new(match pinned {
            Some(n) => InFlight::pinned(n),
            None => InFlight::adaptive(),
        })
    });
    Arc::clone(limit)
}

/// One object: the store that serves it and its path there.
#[derive(Clone)]
struct Location {
    url: String,
    store: Arc<dyn ObjectStore>,
    path: ObjectPath,
    /// The GETs in flight to its server.
    limit: Arc<InFlight>,
}

/// The store for `url` and the object's path in it. Stores are kept per bucket (or host) so
/// that the files of a checkpoint share connections.
fn locate(url: &str) -> Result<Location> {
    static STORES: OnceLock<Mutex<HashMap<String, Arc<dyn ObjectStore>>>> = OnceLock::new();
    let invalid = |reason: String| Error::InvalidUrl { url: shown(url), reason };
    let parsed = Url::parse(url).map_err(|e| invalid(e.to_string()))?;
    let (mut scheme, path) = ObjectStoreScheme::parse(&parsed).map_err(|e| invalid(one_line(&e.to_string())))?;
    // An HTTP(S) URL with a query string is fetched as it is, query included, on every request:
    // the query picks the version (`?v=2`) or carries the request's own authorization (a
    // presigned URL), which signing with the environment's credentials would replace.
    let query = parsed.query().filter(|_| matches!(parsed.scheme(), "http" | "https"));
    let path = match query {
        Some(_) => {
            scheme = ObjectStoreScheme::Http;
            ObjectPath::parse(parsed.path()).map_err(|e| invalid(one_line(&e.to_string())))?
        }
        // The key of an s3:// URL is read as the AWS CLI reads it: the text after the bucket
        // as written (`%20` is those three characters, not a space).
        None if matches!(parsed.scheme(), "s3" | "s3a") => {
            let key = url.split_once("://").and_then(|(_, rest)| rest.split_once('/')).map_or("", |(_, key)| key);
            ObjectPath::parse(key).map_err(|e| invalid(one_line(&e.to_string())))?
        }
        None => path,
    };
    // One store per host, and per first path segment where that can be the bucket
    // (https://s3.region.amazonaws.com/bucket/...), and per configuration: a test, or a
    // program that switches credentials, gets a store built with what the environment says now.
    let mut key = server_of(&parsed);
    if scheme != ObjectStoreScheme::Http {
        key.push('/');
        key.push_str(parsed.path().trim_start_matches('/').split('/').next().unwrap_or(""));
    }
    // The AWS CLI's files, for S3 only: a profile's values are part of its store's identity.
    let profile = match scheme {
        ObjectStoreScheme::AmazonS3 => {
            aws_files::profile_from_env().map_err(|reason| Error::RemoteConfig { url: shown(url), reason })?
        }
        _ => None,
    };
    key.push_str(&format!("#{:x}", config_hash(&profile)));
    if let Some(query) = query {
        key.push_str(&format!("?{:x}", text_hash(query)));
    }
    if !parsed.username().is_empty() || parsed.password().is_some() {
        key.push_str(&format!("@{:x}", text_hash(&parsed[url::Position::BeforeUsername..url::Position::BeforeHost])));
    }
    let mut stores = STORES.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
    let store = match stores.get(&key) {
        Some(store) => Arc::clone(store),
        None => {
            let store = build_store(scheme, &parsed, url, profile)?;
            stores.insert(key, Arc::clone(&store));
            store
        }
    };
    drop(stores);
    let limit = in_flight(&server_of(&parsed), RemoteSettings::from_env()?.concurrency);
    Ok(Location { url: shown(url), store, path, limit })
}

/// A hash of what the stores are configured from: the environment variables, and the AWS
/// profile read from the CLI's files.
fn config_hash(profile: &Option<aws_files::Profile>) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut vars: Vec<(String, String)> = std::env::vars()
        .filter(|(k, _)| ["AWS_", "GOOGLE_", "AZURE_", "FASTSAFETENSORS_REMOTE_"].iter().any(|p| k.starts_with(p)))
        .collect();
    vars.sort();
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    vars.hash(&mut hasher);
    profile.hash(&mut hasher);
    hasher.finish()
}

/// `scheme://host:port` of `url`: its server, without user name or password.
fn server_of(url: &Url) -> String {
    format!("{}://{}", url.scheme(), &url[url::Position::BeforeHost..url::Position::BeforePath])
}

/// A hash of `text`, for a store's key (where the text itself, a query string, may be secret).
fn text_hash(text: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    text.hash(&mut hasher);
    hasher.finish()
}

/// A store for `url`'s scheme, configured from the environment (and for S3, where a variable
/// gives no value, from the AWS CLI's `profile`).
fn build_store(
    scheme: ObjectStoreScheme,
    parsed: &Url,
    url: &str,
    profile: Option<aws_files::Profile>,
) -> Result<Arc<dyn ObjectStore>> {
    let settings = RemoteSettings::from_env()?;
    // One try per call: the retries are [`Retries`]' (object_store's backoff is jittered so
    // widely that 10 retries can be over in 2 s, too soon for a server that restarts).
    let retry = RetryConfig { backoff: BackoffConfig::default(), max_retries: 0, retry_timeout: RETRY_WINDOW };
    let timeout = format!("{}s", settings.timeout.as_secs());
    let connect = format!("{}s", settings.timeout.as_secs().min(10));
    let failed = |e: object_store::Error| Error::InvalidUrl { url: shown(url), reason: one_line(&e.to_string()) };
    let store: Arc<dyn ObjectStore> = match scheme {
        ObjectStoreScheme::AmazonS3 => {
            let mut b = AmazonS3Builder::from_env().with_url(url).with_retry(retry);
            half_a_key(&b).map_err(|reason| Error::RemoteConfig { url: shown(url), reason })?;
            if let Some(profile) = profile {
                b = with_profile(b, profile);
            }
            // AWS_ENDPOINT_URL is what the AWS CLI reads; object_store knows it as aws_endpoint.
            let endpoint = b.get_config_value(&AmazonS3ConfigKey::Endpoint);
            if endpoint.as_deref().is_some_and(|e| e.starts_with("http://")) {
                b = b.with_allow_http(true);
            }
            let client = |k| AmazonS3ConfigKey::Client(k);
            b = b
                .with_config(client(ClientConfigKey::Timeout), &timeout)
                .with_config(client(ClientConfigKey::ConnectTimeout), &connect);
            Arc::new(b.build().map_err(failed)?)
        }
        ObjectStoreScheme::GoogleCloudStorage => {
            let client = |k| GoogleConfigKey::Client(k);
            let b = GoogleCloudStorageBuilder::from_env()
                .with_url(url)
                .with_retry(retry)
                .with_config(client(ClientConfigKey::Timeout), &timeout)
                .with_config(client(ClientConfigKey::ConnectTimeout), &connect);
            Arc::new(b.build().map_err(failed)?)
        }
        ObjectStoreScheme::MicrosoftAzure => {
            let client = |k| AzureConfigKey::Client(k);
            let b = MicrosoftAzureBuilder::from_env()
                .with_url(url)
                .with_retry(retry)
                .with_config(client(ClientConfigKey::Timeout), &timeout)
                .with_config(client(ClientConfigKey::ConnectTimeout), &connect);
            Arc::new(b.build().map_err(failed)?)
        }
        ObjectStoreScheme::Http => {
            // The store appends each object's path to its URL, and keeps the URL's query.
            // The user name and password go as Basic authorization, on every request to this
            // host (the store's URL is this one host's), never in the URL the client sees.
            let host = server_of(parsed);
            let base = match parsed.query() {
                Some(query) => format!("{host}/?{query}"),
                None => host,
            };
            let mut options = ClientOptions::new();
            if let Some(authorization) = basic_authorization(parsed) {
                let mut headers = http::HeaderMap::new();
                headers.insert(http::header::AUTHORIZATION, authorization);
                options = options.with_default_headers(headers);
            }
            let b = HttpBuilder::new()
                .with_client_options(options)
                .with_url(base)
                .with_retry(retry)
                .with_config(ClientConfigKey::AllowHttp, "true")
                .with_config(ClientConfigKey::Timeout, &timeout)
                .with_config(ClientConfigKey::ConnectTimeout, &connect);
            Arc::new(b.build().map_err(failed)?)
        }
        _ => return Err(Error::InvalidUrl { url: shown(url), reason: "not an object store URL".to_owned() }),
    };
    Ok(store)
}

/// The `Authorization: Basic` value of the user name and password in `url`, if it has them.
fn basic_authorization(url: &Url) -> Option<http::HeaderValue> {
    use base64::Engine;
    if url.username().is_empty() && url.password().is_none() {
        return None;
    }
    let decode = |text: &str| percent_encoding::percent_decode_str(text).collect::<Vec<u8>>();
    let mut pair = decode(url.username());
    pair.push(b':');
    pair.extend(decode(url.password().unwrap_or("")));
    let token = base64::engine::general_purpose::STANDARD.encode(pair);
    let mut value = http::HeaderValue::from_str(&format!("Basic {token}")).ok()?;
    value.set_sensitive(true);
    Some(value)
}

/// The environment's key refused where it gives one half of it, as the AWS CLI refuses it:
/// the other half is not looked for in the files (a key id and a secret from two places are no
/// key, and the failure would be the store's "access denied" or "missing AccessKeyId").
fn half_a_key(b: &AmazonS3Builder) -> std::result::Result<(), String> {
    let set = |k| b.get_config_value(&k).is_some();
    let (with, without) = match (set(AmazonS3ConfigKey::AccessKeyId), set(AmazonS3ConfigKey::SecretAccessKey)) {
        (true, false) => ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"),
        (false, true) => ("AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID"),
        _ => return Ok(()),
    };
    Err(format!(
        "{with} is set but {without} is not: set both, or neither to use the AWS CLI's files (one half of a key is \
         never paired with the other half from elsewhere)"
    ))
}

/// `b` with the profile's values where the environment gave none. Credentials go as a pair:
/// a key id from the environment is never matched with a secret from a file.
fn with_profile(mut b: AmazonS3Builder, profile: aws_files::Profile) -> AmazonS3Builder {
    let unset = |b: &AmazonS3Builder, k| b.get_config_value(&k).is_none();
    if unset(&b, AmazonS3ConfigKey::AccessKeyId) && unset(&b, AmazonS3ConfigKey::SecretAccessKey) {
        if let (Some(id), Some(secret)) = (profile.access_key_id, profile.secret_access_key) {
            b = b.with_access_key_id(id).with_secret_access_key(secret);
            if let Some(token) = profile.session_token {
                b = b.with_token(token);
            }
        }
    }
    if let (true, Some(region)) = (unset(&b, AmazonS3ConfigKey::Region), profile.region) {
        b = b.with_region(region);
    }
    if let (true, Some(endpoint)) = (unset(&b, AmazonS3ConfigKey::Endpoint), profile.endpoint_url) {
        b = b.with_endpoint(endpoint);
    }
    b
}

/// An object in a store, opened at one version: the [`Source`] for a URL.
pub struct RemoteObject {
    path: PathBuf,
    at: Location,
    identity: Identity,
    /// The object's first bytes, fetched when it was opened (its header, usually).
    prefix: Bytes,
    settings: RemoteSettings,
    /// Where the bytes read are copied for the next load, if the cache is on.
    cache: Option<CacheWriter>,
    /// Set by [`Source::cancel`]: reads stop.
    cancelled: AtomicBool,
}

impl RemoteObject {
    /// Opens the object at `url` with one GET of its first bytes, which fixes its version.
    pub fn open(url: &str) -> Result<RemoteObject> {
        let settings = RemoteSettings::from_env()?;
        let at = locate(url)?;
        let (identity, prefix) = block_on(async {
            let options = GetOptions { range: Some((0..SPECULATIVE_HEADER).into()), ..Default::default() };
            let at = &at;
            // The body is read inside the retries: a first answer cut short is asked for again,
            // as a part's is (its meta and bytes come from the same answer).
            let (meta, attributes, range, bytes) = with_retries(&at.url, &settings, || async {
                let got = match at.store.get_opts(&at.path, options.clone()).await {
                    // An empty object has no range to give: ask for it whole.
                    Err(e) if is_unsatisfiable(&e) => at.store.get_opts(&at.path, GetOptions::default()).await,
                    got => got,
                }?;
                let (meta, attributes, range) = (got.meta.clone(), got.attributes.clone(), got.range.clone());
                Ok((meta, attributes, range, got.bytes().await?))
            })
            .await?;
            uncompressed(&at.url, &attributes)?;
            let identity = identity_of(&meta);
            if bytes.len() as u64 != range.end - range.start {
                return Err(short_answer(&at.url, range.start, range.end - range.start, bytes.len() as u64));
            }
            Ok((identity, bytes))
        })?;
        if let Identity::Object { e_tag: None, version: None, modified: None, .. } = &identity {
            say_once(
                &at.url,
                "the server gives neither an ETag nor a Last-Modified date, so the object cannot be \
                pinned to one version: only its size is checked on every read (a replacement of the same size \
                during the load would go unseen)",
            );
        }
        Ok(RemoteObject {
            path: PathBuf::from(url),
            at,
            identity,
            prefix,
            settings,
            cache: None,
            cancelled: AtomicBool::new(false),
        })
    }

    /// From now on, the bytes read are also written to the object's entry in the cache at
    /// `dir` (see [`super::cache`]), from the first ones, fetched already.
    pub fn cache_into(&mut self, dir: &Path) {
        self.cache = CacheWriter::start(dir, self.path.to_str().unwrap_or_default(), &self.identity);
        if let Some(cache) = &self.cache {
            cache.write(0, self.prefix.clone());
        }
    }

    /// The object's first bytes, as fetched when it was opened.
    pub fn prefix(&self) -> &[u8] {
        &self.prefix
    }

    /// The URL as errors show it.
    pub fn url(&self) -> &str {
        &self.at.url
    }

    /// The options of a GET of `range` on the version opened: `If-Match` its ETag and its
    /// version id where the store gives them, else `If-Unmodified-Since` its Last-Modified
    /// date (an ETag is the stronger validator; with both, servers ignore the date).
    fn conditional(&self, range: std::ops::Range<u64>) -> GetOptions {
        let mut options = GetOptions { range: Some(range.into()), ..Default::default() };
        if let Identity::Object { e_tag, version, modified, .. } = &self.identity {
            options.if_match = e_tag.clone();
            options.version = version.clone();
            if e_tag.is_none() {
                options.if_unmodified_since = modified.map(chrono::DateTime::<chrono::Utc>::from);
            }
        }
        options
    }

    /// Fetches `dst.len()` bytes from `start` with one GET on the opened version.
    async fn get_into(&self, start: u64, dst: &mut [u8]) -> Result<()> {
        let _slot = self.at.limit.slot().await;
        // The pages this GET fills are made in one call now, while its request is on its way,
        // rather than one fault per page under the copy (a tenth less client CPU per GB here).
        source::prefault(dst);
        let mut retries = Retries::new(&self.settings);
        // A failed request, or a body cut short, is asked for again whole.
        loop {
            let options = self.conditional(start..start + dst.len() as u64);
            let got = match self.at.store.get_opts(&self.at.path, options).await {
                Ok(got) => got,
                Err(e) if retries.again(&e).await => continue,
                Err(e) => return Err(retries.give_up(&self.at.url, e)),
            };
            // A store that ignored the condition still says which version it sent.
            if !self.same_version(&identity_of(&got.meta)) {
                return Err(Error::RemoteChanged { url: self.at.url.clone() });
            }
            // Checked on every answer, not only the first: a CDN may compress some and not others.
            uncompressed(&self.at.url, &got.attributes)?;
            let mut body = got.into_stream();
            let mut done = 0usize;
            let mut cut = None;
            while let Some(chunk) = body.next().await {
                let chunk = match chunk {
                    Ok(chunk) => chunk,
                    Err(e) => {
                        cut = Some(e);
                        break;
                    }
                };
                let Some(to) = dst.get_mut(done..done + chunk.len()) else {
                    return Err(Error::Remote {
                        url: self.at.url.clone(),
                        detail: format!("the server sent more than the {} bytes asked for at byte {start}", dst.len()),
                    });
                };
                to.copy_from_slice(&chunk);
                if let Some(cache) = &self.cache {
                    cache.write(start + done as u64, chunk.clone());
                }
                done += chunk.len();
            }
            match cut {
                Some(e) if retries.again(&e).await => continue,
                Some(e) => return Err(retries.give_up(&self.at.url, e)),
                // The body ended where its own framing (Content-Length) said, before the range
                // its Content-Range promised: a server that miscounts, which a retry would not mend.
                None if done < dst.len() => {
                    return Err(short_answer(&self.at.url, start, dst.len() as u64, done as u64))
                }
                None => {
                    self.at.limit.landed(done as u64);
                    return Ok(());
                }
            }
        }
    }

    /// `reads`, unless the object is cancelled or the thread's read stops being wanted
    /// ([`source::read_while`]) first: then an error, and the requests are dropped.
    async fn unless_cancelled(&self, reads: impl Future<Output = Result<()>>) -> Result<()> {
        let wanted = source::wanted();
        let given_up = async {
            loop {
                tokio::time::sleep(CANCEL_CHECK).await;
                if self.cancelled.load(Ordering::Relaxed) || wanted.as_ref().is_some_and(|w| !w()) {
                    return;
                }
            }
        };
        if self.cancelled.load(Ordering::Relaxed) {
            return Err(Error::Cancelled { path: self.path.clone() });
        }
        tokio::select! {
            done = reads => done,
            () = given_up => Err(Error::Cancelled { path: self.path.clone() }),
        }
    }

    /// Whether `now` is the version opened: the same size, and the same ETag, version id and
    /// Last-Modified date where the store gives them.
    fn same_version(&self, now: &Identity) -> bool {
        fn agree<T: PartialEq>(a: &Option<T>, b: &Option<T>) -> bool {
            a.is_none() || b.is_none() || a == b
        }
        match (&self.identity, now) {
            (
                Identity::Object { len, e_tag, version, modified },
                Identity::Object { len: now_len, e_tag: now_tag, version: now_version, modified: now_modified },
            ) => {
                len == now_len && agree(e_tag, now_tag) && agree(version, now_version) && agree(modified, now_modified)
            }
            _ => false,
        }
    }
}

/// One ranged GET of a read, run as a task on the runtime: its bytes are copied into the
/// caller's buffer on the worker thread that received them, with no hand-off to the thread
/// that waits for the read (on 2 cores, that hand-off per chunk cost a fifth of the CPU).
struct Part {
    object: *const RemoteObject,
    start: u64,
    dst: *mut u8,
    len: usize,
}

// SAFETY: a `Part` is a `&RemoteObject` (which is `Sync`) and a `&mut [u8]` of its own, both
// kept alive by the `read_at` that made it until its task is over (see `PartTasks`).
unsafe impl Send for Part {}

impl Part {
    /// The GET, as a future that owns its part.
    ///
    /// # Safety
    /// The object and the bytes at `dst` must outlive the future, and nothing else may touch
    /// those bytes meanwhile.
    async unsafe fn fetch(self) -> Result<()> {
        let Part { object, start, dst, len } = self;
        let (object, dst) = unsafe { (&*object, std::slice::from_raw_parts_mut(dst, len)) };
        object.get_into(start, dst).await
    }
}

/// The tasks of one read. Dropped, it stops them and waits until each is over, so that none
/// still writes into the caller's buffer once `read_at` has returned (with an error, or by
/// unwinding) and the buffer may be freed.
struct PartTasks(Vec<tokio::task::JoinHandle<Result<()>>>);

impl Drop for PartTasks {
    fn drop(&mut self) {
        for task in &self.0 {
            task.abort();
        }
        // A task running when aborted stops at its next await, within microseconds; the wait
        // is only ever on the error path (a finished read's tasks are all over).
        while !self.0.iter().all(|task| task.is_finished()) {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

impl Source for RemoteObject {
    fn path(&self) -> &Path {
        &self.path
    }

    fn identity(&self) -> &Identity {
        &self.identity
    }

    fn current_identity(&self) -> Result<Identity> {
        let meta = block_on(with_retries(&self.at.url, &self.settings, || self.at.store.head(&self.at.path)))?;
        Ok(identity_of(&meta))
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        let end = offset.saturating_add(buf.len() as u64).min(self.len());
        if offset >= end {
            return Ok(0);
        }
        let n = (end - offset) as usize;
        // What the opening GET brought is not asked for again.
        let held = (self.prefix.len() as u64).clamp(offset, end) - offset;
        if held > 0 {
            buf[..held as usize].copy_from_slice(&self.prefix[offset as usize..(offset + held) as usize]);
        }
        if held == n as u64 {
            return Ok(n);
        }
        let (offset, rest) = (offset + held, &mut buf[held as usize..n]);
        let part = self.settings.part_size as usize;
        let rt = runtime()?;
        let mut tasks = PartTasks(Vec::new());
        for (i, dst) in rest.chunks_mut(part).enumerate() {
            let part = Part { object: self, start: offset + (i * part) as u64, dst: dst.as_mut_ptr(), len: dst.len() };
            // SAFETY: `tasks` is dropped (which waits until every task has stopped) before this
            // function returns or unwinds, so `self` and `buf` outlive each task's use of them;
            // the parts are disjoint slices of `buf`.
            tasks.0.push(rt.spawn(unsafe { part.fetch() }));
        }
        let reads = tasks.0.iter_mut().collect::<stream::FuturesUnordered<_>>().map(|joined| match joined {
            Ok(read) => read,
            Err(e) => Err(Error::io(self.path(), "read", std::io::Error::other(format!("a part's task failed: {e}")))),
        });
        block_on(self.unless_cancelled(reads.try_collect::<()>()))?;
        Ok(n)
    }

    /// Stops the requests in flight within [`CANCEL_CHECK`]: they are dropped, so nothing
    /// writes into the caller's buffers after `read_at` returns.
    fn cancel(&self) {
        self.cancelled.store(true, Ordering::Relaxed);
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities { direct: false, mmap: false, gds: false }
    }

    fn local(&self) -> Option<&LocalFile> {
        None
    }

    fn splits_reads(&self) -> bool {
        true
    }

    /// The version the store names, rather than pages fetched one GET each.
    fn fingerprint(&self) -> Result<String> {
        match self.identity.version_fingerprint() {
            Some(fingerprint) => Ok(fingerprint),
            None => sampled_fingerprint(self, |page, offset| self.read_at(page, offset)),
        }
    }

    /// Every GET was conditional on the version opened (where the store gives one), so a
    /// replaced object failed its reads already; without an ETag or version id (a Last-Modified
    /// date has a resolution of a second), ask once more.
    fn check_unchanged(&self) -> Result<()> {
        if let Identity::Object { e_tag: None, version: None, .. } = &self.identity {
            if !self.same_version(&self.current_identity()?) {
                return Err(Error::RemoteChanged { url: self.at.url.clone() });
            }
        }
        Ok(())
    }

    /// The header from the bytes fetched at open; a second GET only for a larger header.
    fn header(&self) -> Result<Header> {
        let format_err = |source| Error::Format { path: self.path.clone(), source };
        let len = format::header_len(&self.prefix, self.len()).map_err(format_err)?;
        let end = format::LEN_PREFIX + len;
        let json = if end <= self.prefix.len() as u64 {
            self.prefix[format::LEN_PREFIX as usize..end as usize].to_vec()
        } else {
            let mut json = vec![0u8; len as usize];
            let got = self.read_at(&mut json, format::LEN_PREFIX)?;
            if got < json.len() {
                return Err(Error::Truncated {
                    path: self.path.clone(),
                    at: format::LEN_PREFIX + got as u64,
                    expected: self.len(),
                });
            }
            json
        };
        format::parse_header(&json, self.len()).map_err(format_err)
    }
}

/// The objects directly under the prefix `url` (a "directory": deeper ones are not listed),
/// as URLs, in name order.
pub fn list(url: &str) -> Result<Vec<String>> {
    let at = locate(url)?;
    if url.starts_with("http://") || url.starts_with("https://") {
        return Err(Error::InvalidUrl {
            url: at.url,
            reason: "an HTTP server cannot be listed: pass the checkpoint's *.safetensors.index.json URL, or each file's URL"
                .to_owned(),
        });
    }
    let settings = RemoteSettings::from_env()?;
    let listed = block_on(with_retries(&at.url, &settings, || at.store.list_with_delimiter(Some(&at.path))))?;
    let base = at.url.trim_end_matches('/');
    let mut urls: Vec<String> =
        listed.objects.iter().filter_map(|o| o.location.filename().map(|name| format!("{base}/{name}"))).collect();
    urls.sort();
    Ok(urls)
}

/// The whole object at `url` (an index: at most 100 MB).
pub fn read_small(url: &str) -> Result<Vec<u8>> {
    let at = locate(url)?;
    let settings = RemoteSettings::from_env()?;
    block_on(async {
        let got = with_retries(&at.url, &settings, || at.store.get_opts(&at.path, GetOptions::default())).await?;
        if got.meta.size > MAX_SMALL_OBJECT {
            return Err(Error::InvalidIndex {
                path: PathBuf::from(&at.url),
                reason: format!("it is {} bytes, more than an index can be", got.meta.size),
            });
        }
        Ok(got.bytes().await.map_err(|e| remote_error(&at.url, e))?.to_vec())
    })
}

/// Why each of `urls` cannot be read (None for those that are there), with one HEAD each,
/// in parallel.
pub fn missing(urls: &[String]) -> Vec<Option<String>> {
    block_on(async { Ok(stream::iter(urls).map(|u| why_missing(u)).buffered(16).collect::<Vec<_>>().await) })
        .unwrap_or_else(|e| vec![Some(e.to_string()); urls.len()])
}

/// Why the object at `url` cannot be read, or None.
async fn why_missing(url: &str) -> Option<String> {
    let at = match locate(url) {
        Ok(at) => at,
        Err(e) => return Some(e.to_string()),
    };
    let settings = match RemoteSettings::from_env() {
        Ok(settings) => settings,
        Err(e) => return Some(e.to_string()),
    };
    match with_retries(&at.url, &settings, || at.store.head(&at.path)).await {
        Ok(_) => None,
        Err(Error::RemoteNotFound { .. }) => Some("does not exist".to_owned()),
        Err(e) => Some(format!("cannot be read: {e}")),
    }
}

/// `name` (a shard, relative to the index) beside the object at `url`.
pub fn sibling(url: &str, name: &str) -> String {
    match url.rsplit_once('/') {
        Some((folder, _)) => format!("{folder}/{name}"),
        None => name.to_owned(),
    }
}

/// Refuses an answer whose body was compressed by the server (`Content-Encoding` other than
/// identity): ranges address the object's own bytes, not the compressed ones, and the client
/// never asks for compression.
fn uncompressed(url: &str, attributes: &object_store::Attributes) -> Result<()> {
    match attributes.get(&Attribute::ContentEncoding) {
        Some(encoding) if !encoding.eq_ignore_ascii_case("identity") => Err(Error::RemoteAnswer {
            url: url.to_owned(),
            reason: format!(
                "the server sent it with Content-Encoding: {}, which was not asked for: ranged reads need the \
                 object's own bytes, so serve (or store) it uncompressed",
                &**encoding
            ),
        }),
        _ => Ok(()),
    }
}

/// The error for an answer to a GET of `asked` bytes from `start` whose body ended, cleanly,
/// after `got` bytes: its Content-Length and Content-Range disagree.
fn short_answer(url: &str, start: u64, asked: u64, got: u64) -> Error {
    Error::RemoteAnswer {
        url: url.to_owned(),
        reason: format!(
            "the server's answer to a GET of bytes {start}-{} ended after {got} of them: its Content-Length is \
             shorter than the range its Content-Range says it sends",
            start + asked - 1
        ),
    }
}

/// What is wrong with an answer that object_store refused before its body was read, in
/// words a user can act on; None for other errors. (object_store's error types for these are
/// private: their messages, pinned by Cargo.lock, are what tells them apart.)
fn answer_problem(text: &str) -> Option<String> {
    let reason = if text.contains("too many redirects") {
        // reqwest's default policy, which object_store keeps: at most 10 redirects.
        "the server redirected the request more than 10 times (a redirect loop, or a chain longer than \
         the 10 redirects followed)"
            .to_owned()
    } else if text.contains("Received redirect without LOCATION") {
        "the server answered with a redirect (3xx) that has no Location header: there is nowhere to follow it"
            .to_owned()
    } else if text.contains("Received non-partial response when range requested")
        || text.contains("Range request not supported by")
    {
        // The second is the HTTP store's own check of the same thing.
        "the server answered a ranged GET with 200 and the whole object instead of 206 and the range: it \
         ignores Range, and a load needs a server that supports Range requests (a whole body is never read \
         as the part asked for)"
            .to_owned()
    } else if text.contains("Content-Range header not present in partial response") {
        "the server answered a ranged GET with 206 but no Content-Range header, so which bytes it sent is \
         unknown"
            .to_owned()
    } else if let Some(what) = text
        .match_indices("Requested ")
        .map(|(i, _)| &text[i..])
        .find(|rest| rest[10..].starts_with(|c: char| c.is_ascii_digit()) && rest.contains(", got "))
    {
        // object_store's "Requested 0..65536, got 0..1000", not a reason phrase ("Requested
        // Range Not Satisfiable").
        format!("the server sent other bytes than the range asked for ({what}; ranges are end-exclusive)")
    } else if text.contains("Failed to parse value for CONTENT_RANGE") {
        "the server's Content-Range header is not one range of a known size (bytes START-END/SIZE)".to_owned()
    } else {
        return None;
    };
    Some(reason)
}

/// The version `meta` describes. A missing Last-Modified header comes from the store as the
/// epoch: that is no date.
fn identity_of(meta: &object_store::ObjectMeta) -> Identity {
    let modified = (meta.last_modified.timestamp_nanos_opt() != Some(0)).then(|| meta.last_modified.into());
    Identity::Object { len: meta.size, e_tag: meta.e_tag.clone(), version: meta.version.clone(), modified }
}

/// Says `what` about `url` on standard error, once per URL in the process.
fn say_once(url: &str, what: &str) {
    static SAID: OnceLock<Mutex<std::collections::HashSet<String>>> = OnceLock::new();
    let mut said = SAID.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
    if said.insert(url.to_owned()) {
        eprintln!("fastsafetensors: {url}: {what}");
    }
}

/// The retries of one request: after a failure a retry can mend (a 5xx or 429 answer, a
/// connection refused or reset, a timeout, a body cut short), wait 0.1 s, then twice as long
/// each time, at most 8 s; at most `$FASTSAFETENSORS_REMOTE_RETRIES` times, and not past
/// [`RETRY_WINDOW`] after the first try. 10 retries span 0.1 + 0.2 + ... + 6.4 + 8 + 8 + 8 =
/// 36.7 s.
struct Retries {
    first: std::time::Instant,
    gap: Duration,
    done: usize,
    max: usize,
}

impl Retries {
    fn new(settings: &RemoteSettings) -> Retries {
        Retries { first: std::time::Instant::now(), gap: FIRST_RETRY_GAP, done: 0, max: settings.retries }
    }

    /// Whether to try again after `e`; if so, once the gap has passed.
    async fn again(&mut self, e: &object_store::Error) -> bool {
        if !retryable(e) {
            return false;
        }
        match self.next_wait(self.first.elapsed()) {
            Some(wait) => {
                tokio::time::sleep(wait).await;
                true
            }
            None => false,
        }
    }

    /// The wait before the next try, after a failure a retry may mend `elapsed` after the
    /// first try; None: no more tries.
    fn next_wait(&mut self, elapsed: Duration) -> Option<Duration> {
        if self.done >= self.max || elapsed + self.gap > RETRY_WINDOW {
            return None;
        }
        let wait = self.gap;
        self.gap = (self.gap * 2).min(MAX_RETRY_GAP);
        self.done += 1;
        Some(wait)
    }

    /// The error `e` ends the request with, saying how long it was retried.
    fn give_up(&self, url: &str, e: object_store::Error) -> Error {
        let mut error = remote_error(url, e);
        if let (Error::Remote { detail, .. }, 1..) = (&mut error, self.done) {
            detail.push_str(&format!(", after {} retries over {:.1} s", self.done, self.first.elapsed().as_secs_f64()));
        }
        error
    }
}

/// `call()` until it succeeds or [`Retries`] gives up.
async fn with_retries<T, F: Future<Output = object_store::Result<T>>>(
    url: &str,
    settings: &RemoteSettings,
    mut call: impl FnMut() -> F,
) -> Result<T> {
    let mut retries = Retries::new(settings);
    loop {
        match call().await {
            Ok(done) => return Ok(done),
            Err(e) if retries.again(&e).await => {}
            Err(e) => return Err(retries.give_up(url, e)),
        }
    }
}

/// Whether a retry may mend `e`: the connection failed, timed out or was cut, or the server
/// answered 5xx or 429 (busy, throttling, restarting). Not a 4xx, nor a changed version.
fn retryable(e: &object_store::Error) -> bool {
    use object_store::client::{HttpError, HttpErrorKind};
    let object_store::Error::Generic { source, .. } = e else { return false };
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(source.as_ref());
    while let Some(c) = cause {
        if let Some(http) = c.downcast_ref::<HttpError>() {
            return matches!(
                http.kind(),
                HttpErrorKind::Connect | HttpErrorKind::Request | HttpErrorKind::Timeout | HttpErrorKind::Interrupted
            );
        }
        cause = c.source();
    }
    // An answer's status, as object_store writes it ("non-2xx status code: 503 Service ...").
    let text = chain(e);
    text.split("status code: ").skip(1).any(|rest| rest.starts_with('5') || rest.starts_with("429"))
}

/// A range past the end of an empty object.
fn is_unsatisfiable(e: &object_store::Error) -> bool {
    chain(e).contains("416")
}

/// The error, with the source chain, on one line.
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut parts = vec![e.to_string()];
    let mut next = e.source();
    while let Some(cause) = next {
        let text = cause.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        next = cause.source();
    }
    one_line(&parts.join(": "))
}

/// `text` on one line, its URLs without query strings, and not too long to read.
fn one_line(text: &str) -> String {
    let words: Vec<String> =
        text.split_whitespace().map(|w| if w.contains("://") { shown(w) } else { w.to_owned() }).collect();
    let mut line = words.join(" ");
    if line.len() > 400 {
        let cut = (0..=400).rev().find(|&i| line.is_char_boundary(i)).unwrap_or(0);
        line.truncate(cut);
        line.push_str(" ...");
    }
    line
}

/// What a failed request for credentials mentions: the stores look for them in the
/// environment first, then ask the cloud's metadata service (absent off the cloud).
const CREDENTIAL_SOURCES: &[&str] = &[
    "credential",
    "Credential",
    "/latest/api/token",  // AWS instance metadata (IMDSv2)
    "/latest/meta-data",  // AWS instance metadata
    "computeMetadata",    // GCP metadata server
    "/metadata/identity", // Azure managed identity
];

/// The text between `<tag>` and `</tag>` in an S3-style XML error body.
fn xml_field<'a>(text: &'a str, tag: &str) -> Option<&'a str> {
    let open = format!("<{tag}>");
    let start = text.find(&open)? + open.len();
    let len = text[start..].find("</")?;
    Some(&text[start..start + len])
}

/// What went wrong with a request for `url`, as one of the crate's errors. The server's
/// error body is not repeated (it can echo the access key id); only its error code is.
pub(crate) fn remote_error(url: &str, e: object_store::Error) -> Error {
    let text = chain(&e);
    let code = xml_field(&text, "Code").map(str::to_owned);
    let url = url.to_owned();
    match e {
        object_store::Error::NotFound { .. } => {
            let bucket = matches!(code.as_deref(), Some("NoSuchBucket" | "ContainerNotFound"));
            Error::RemoteNotFound { url, what: if bucket { "bucket (or container)" } else { "object" } }
        }
        object_store::Error::Precondition { .. } | object_store::Error::NotModified { .. } => {
            Error::RemoteChanged { url }
        }
        object_store::Error::PermissionDenied { .. } | object_store::Error::Unauthenticated { .. } => {
            Error::RemoteDenied { url, code: code.unwrap_or_else(|| "access denied".to_owned()) }
        }
        object_store::Error::Generic { .. } | object_store::Error::NotSupported { .. }
            if answer_problem(&text).is_some() =>
        {
            Error::RemoteAnswer { url, reason: answer_problem(&text).unwrap_or_default() }
        }
        _ if CREDENTIAL_SOURCES.iter().any(|m| text.contains(m)) => Error::RemoteNoCredentials { url },
        _ => {
            // The request's cause, without the server's body (see above), nor the store's
            // name ("Generic S3 error: "), which the URL says already.
            let text = match text.find(" error: ") {
                Some(i) if text.starts_with("Generic ") => text[i + " error: ".len()..].to_owned(),
                _ => text,
            };
            let detail = match text.find('<') {
                Some(body) => text[..body].trim_end().to_owned(),
                None => text,
            };
            let detail = detail.trim_end_matches(':').to_owned();
            Error::Remote { url, detail: code.map_or(detail.clone(), |c| format!("{detail} ({c})")) }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_told_from_paths() {
        for url in
            ["s3://b/k.safetensors", "gs://b/k", "az://c/k", "https://h/x", "http://127.0.0.1:9/x", "abfss://c@a/x"]
        {
            assert!(is_url(Path::new(url)), "{url}");
        }
        for path in ["model.safetensors", "/tmp/s3:/x", "file:///tmp/x", "ftp://h/x", "dir/s3://x"] {
            assert!(!is_url(Path::new(path)), "{path}");
        }
    }

    #[test]
    fn shown_urls_leave_out_the_query() {
        assert_eq!(shown("https://h/m.safetensors?X-Amz-Signature=abc#f"), "https://h/m.safetensors");
        assert_eq!(one_line("GET https://h/x?sig=1  failed\n  later"), "GET https://h/x failed later");
        assert_eq!(shown("https://user:pa%40ss@h:8/m?s=1"), "https://h:8/m");
        assert_eq!(shown("s3://b/k@1"), "s3://b/k@1");
    }

    #[test]
    fn a_query_string_makes_an_http_store_of_its_own() {
        // An S3-looking host with a query (a presigned URL) is fetched over plain HTTP, as given.
        let signed = locate("https://bucket.s3.us-east-1.amazonaws.com/dir/m.safetensors?X-Amz-Signature=ab").unwrap();
        assert_eq!(signed.path.as_ref(), "dir/m.safetensors");
        assert_eq!(signed.url, "https://bucket.s3.us-east-1.amazonaws.com/dir/m.safetensors");
        let v2 = locate("http://127.0.0.1:9/m.safetensors?v=2").unwrap();
        let v3 = locate("http://127.0.0.1:9/m.safetensors?v=3").unwrap();
        let plain = locate("http://127.0.0.1:9/m.safetensors").unwrap();
        assert!(!Arc::ptr_eq(&v2.store, &v3.store) && !Arc::ptr_eq(&v2.store, &plain.store));
        assert!(Arc::ptr_eq(&v2.store, &locate("http://127.0.0.1:9/other?v=2").unwrap().store));
    }

    #[test]
    fn retries_double_from_a_tenth_of_a_second_to_eight_within_two_minutes() {
        let retries = |max| Retries { first: std::time::Instant::now(), gap: FIRST_RETRY_GAP, done: 0, max };
        // The documented schedule: 10 retries, 0.1 s doubling to at most 8 s, 36.7 s in all.
        let mut r = retries(10);
        let mut elapsed = Duration::ZERO;
        let mut waits = Vec::new();
        while let Some(wait) = r.next_wait(elapsed) {
            waits.push(wait.as_millis());
            elapsed += wait;
        }
        assert_eq!(waits, [100, 200, 400, 800, 1600, 3200, 6400, 8000, 8000, 8000]);
        assert_eq!(elapsed, Duration::from_millis(36_700));
        // However many retries are allowed, none starts past 2 minutes after the first try.
        let mut r = retries(1000);
        let mut elapsed = Duration::ZERO;
        let mut tries = 0;
        while let Some(wait) = r.next_wait(elapsed) {
            elapsed += wait;
            tries += 1;
        }
        assert!(elapsed <= RETRY_WINDOW && elapsed + MAX_RETRY_GAP > RETRY_WINDOW, "{elapsed:?}");
        assert_eq!(tries, 20, "7 doubling gaps (12.7 s), then 13 of 8 s (104 s)");
        // Time spent in the tries themselves counts too.
        assert_eq!(retries(10).next_wait(Duration::from_millis(119_950)), None);
        assert_eq!(retries(0).next_wait(Duration::ZERO), None);
    }

    #[test]
    fn what_a_retry_may_mend() {
        let answered = |text: &str| object_store::Error::Generic { store: "HTTP", source: text.to_owned().into() };
        assert!(retryable(&answered(
            "Error performing GET http://h/x in 1ms - Server returned non-2xx status code: 503 Service Unavailable: "
        )));
        assert!(retryable(&answered("Server returned non-2xx status code: 429 Too Many Requests")));
        assert!(!retryable(&answered("Server returned non-2xx status code: 400 Bad Request")));
        assert!(!retryable(&object_store::Error::NotFound { path: "x".into(), source: "404".into() }));
        assert!(!retryable(&object_store::Error::Precondition { path: "x".into(), source: "412".into() }));
    }

    #[test]
    fn s3_keys_are_read_as_written() {
        assert_eq!(locate("s3://b/sp%20ace/k.safetensors").unwrap().path.as_ref(), "sp%20ace/k.safetensors");
        assert_eq!(locate("s3://b/sp ace/k").unwrap().path.as_ref(), "sp ace/k");
        assert_eq!(locate("s3://b/a+b/c").unwrap().path.as_ref(), "a+b/c");
    }

    #[test]
    fn a_missing_last_modified_is_no_date() {
        let meta = |at: i64| object_store::ObjectMeta {
            location: ObjectPath::from("k"),
            last_modified: chrono::DateTime::from_timestamp(at, 0).unwrap(),
            size: 3,
            e_tag: None,
            version: None,
        };
        assert!(matches!(identity_of(&meta(0)), Identity::Object { modified: None, .. }));
        assert!(matches!(identity_of(&meta(1_700_000_000)), Identity::Object { modified: Some(_), .. }));
    }

    #[test]
    fn settings_are_checked() {
        // Only the parsers: the process environment is shared by the tests.
        let part = |v: &str| parse_size(v).flatten().filter(|n| (64 << 10..=1 << 30).contains(n));
        assert_eq!(part("8M"), Some(8 << 20));
        assert_eq!(part("1K"), None);
        assert_eq!(part("2G"), None);
    }

    #[test]
    fn error_bodies_are_not_repeated() {
        let body =
            "Server returned 500: <Error><Code>InternalError</Code><AWSAccessKeyId>AKIA</AWSAccessKeyId></Error>";
        assert_eq!(xml_field(body, "Code"), Some("InternalError"));
        let e = object_store::Error::Generic { store: "S3", source: body.into() };
        let msg = remote_error("s3://b/k", e).to_string();
        assert!(msg.contains("InternalError") && !msg.contains("AKIA"), "{msg}");
    }

    #[test]
    fn answers_object_store_refused_are_named() {
        let refused = |text: &str| answer_problem(text).unwrap_or_default();
        assert!(refused("HTTP error: error following redirect for url (http://h/x): too many redirects")
            .contains("more than 10 times"));
        assert!(refused("Received non-partial response when range requested").contains("200 and the whole object"));
        assert!(refused("Range request not supported by m.safetensors").contains("200 and the whole object"));
        assert!(refused("Received redirect without LOCATION, this normally ...").contains("no Location header"));
        assert!(refused("Requested 0..65536, got 0..1000").contains("(Requested 0..65536, got 0..1000;"));
        assert!(refused("Content-Range header not present in partial response").contains("no Content-Range"));
        // A 416's reason phrase is not a wrong range; other errors are not these.
        assert_eq!(answer_problem("non-2xx status code: 416 Requested Range Not Satisfiable"), None);
        assert_eq!(answer_problem("Server returned non-2xx status code: 503 Service Unavailable"), None);
        let e = object_store::Error::Generic {
            store: "HTTP",
            source: "Received non-partial response when range requested".into(),
        };
        assert!(matches!(remote_error("http://h/m", e), Error::RemoteAnswer { .. }));
    }

    #[test]
    fn siblings_share_the_folder() {
        assert_eq!(sibling("s3://b/m/model.safetensors.index.json", "a.safetensors"), "s3://b/m/a.safetensors");
    }
}
