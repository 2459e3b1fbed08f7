//! Remote objects through the same paths as files: bulk loads, streams and the staged device
//! pipeline (its host-memory stand-in), read from an HTTP server with range support on
//! 127.0.0.1 (a small one here; the Python suite runs the same against Garage, a real S3
//! server). Parts are 64 KiB, so that every read is split into parallel ranged GETs.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use common::{safetensors, TempDir};

use fastsafetensors::device::staged::{copy_files, StagedFile};
use fastsafetensors::device::{HostMemoryDevice, StagingOptions};
use fastsafetensors::load::stream::{StreamOptions, TensorStream};
use fastsafetensors::load::{plan_files, plan_sources, LoadOptions};
use fastsafetensors::plan::select::{MatchMode, Selection, TensorFilter};
use fastsafetensors::source::direct::BlockReader;
use fastsafetensors::source::{self, ReadPath};
use fastsafetensors::Error;

const TENSORS: &[(&str, &str, &[u64])] =
    &[("a", "F32", &[100_000, 3]), ("b", "BF16", &[40_097]), ("c", "U8", &[5]), ("d", "F64", &[70_001])];

/// Serves one object, `bytes` (replaceable: a new version gets a new ETag), answering GETs
/// with one byte range, `If-Match` and 404 for any other path. Counts the body bytes sent.
struct Server {
    port: u16,
    object: Arc<Mutex<(Vec<u8>, u64)>>,
    sent: Arc<AtomicU64>,
}

impl Server {
    fn start(bytes: Vec<u8>) -> Server {
        // Settings the tests share: small parts, few retries, short timeouts. Set once, by
        // the first test to get here, before any test reads the environment.
        static SETTINGS: std::sync::Once = std::sync::Once::new();
        SETTINGS.call_once(|| {
            std::env::set_var("FASTSAFETENSORS_REMOTE_PART_SIZE", "64K");
            std::env::set_var("FASTSAFETENSORS_REMOTE_RETRIES", "1");
            std::env::set_var("FASTSAFETENSORS_REMOTE_TIMEOUT", "5");
        });
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let object = Arc::new(Mutex::new((bytes, 1)));
        let sent = Arc::new(AtomicU64::new(0));
        let (o, s) = (Arc::clone(&object), Arc::clone(&sent));
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let (o, s) = (Arc::clone(&o), Arc::clone(&s));
                std::thread::spawn(move || serve(conn, &o, &s));
            }
        });
        Server { port, object, sent }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}/m/model.safetensors", self.port)
    }

    fn replace(&self, bytes: Vec<u8>) {
        let mut o = self.object.lock().unwrap();
        *o = (bytes, o.1 + 1);
    }
}

/// Answers the requests of one connection (keep-alive) until the client closes it.
fn serve(conn: TcpStream, object: &Mutex<(Vec<u8>, u64)>, sent: &AtomicU64) {
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut out = conn;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let path = line.split_whitespace().nth(1).unwrap_or("").to_owned();
        let (mut range, mut if_match) = (None, None);
        loop {
            let mut h = String::new();
            if reader.read_line(&mut h).unwrap_or(0) == 0 {
                return;
            }
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            let (k, v) = h.split_once(':').unwrap_or((h, ""));
            match k.to_ascii_lowercase().as_str() {
                "range" => range = Some(v.trim().to_owned()),
                "if-match" => if_match = Some(v.trim().to_owned()),
                _ => {}
            }
        }
        let (bytes, version) = object.lock().unwrap().clone();
        let etag = format!("\"v{version}\"");
        let reply = |out: &mut TcpStream, status: &str, headers: String, body: &[u8]| {
            let head = format!("HTTP/1.1 {status}\r\nContent-Length: {}\r\n{headers}\r\n", body.len());
            out.write_all(head.as_bytes()).and_then(|_| out.write_all(body))
        };
        let result = if path != "/m/model.safetensors" {
            reply(&mut out, "404 Not Found", String::new(), b"")
        } else if if_match.as_ref().is_some_and(|m| *m != etag) {
            reply(&mut out, "412 Precondition Failed", String::new(), b"")
        } else {
            let (a, b) = range
                .as_deref()
                .and_then(|r| r.strip_prefix("bytes="))
                .and_then(|r| r.split_once('-'))
                .map(|(a, b)| (a.parse::<usize>().unwrap(), b.parse::<usize>().unwrap().min(bytes.len() - 1)))
                .unwrap_or((0, bytes.len() - 1));
            sent.fetch_add((b + 1 - a) as u64, Ordering::Relaxed);
            let headers = format!("ETag: {etag}\r\nContent-Range: bytes {a}-{b}/{}\r\n", bytes.len());
            reply(&mut out, "206 Partial Content", headers, &bytes[a..=b])
        };
        if result.is_err() {
            return;
        }
    }
}

/// Each tensor's bytes, by name, as a load of the same bytes from a local file gives them.
fn reference(bytes: &[u8]) -> Vec<(String, Vec<u8>)> {
    let dir = TempDir::new("remote-reference");
    let path = dir.write("model.safetensors", bytes);
    let loaded = plan_files(&[path]).unwrap().read_to_host(&LoadOptions::default()).unwrap();
    loaded.tensors.iter().map(|t| (t.name.clone(), loaded.bytes(t).to_vec())).collect()
}

#[test]
fn a_bulk_load_and_a_stream_of_a_url_are_the_files_bytes() {
    let bytes = safetensors(TENSORS, 8);
    let server = Server::start(bytes.clone());
    let expected = reference(&bytes);
    let loaded = plan_files(&[PathBuf::from(server.url())]).unwrap().read_to_host(&LoadOptions::default()).unwrap();
    assert_eq!(loaded.read_paths(), [ReadPath::Remote]);
    let got: Vec<_> = loaded.tensors.iter().map(|t| (t.name.clone(), loaded.bytes(t).to_vec())).collect();
    assert_eq!(got, expected);

    let planned = plan_files(&[PathBuf::from(server.url())]).unwrap();
    let mut stream = TensorStream::open(planned, StreamOptions::with_budget(256 << 10)).unwrap();
    let mut got = Vec::new();
    while let Some(group) = stream.next_group().unwrap() {
        got.extend(group.tensors.iter().map(|t| (t.name.clone(), group.bytes(t).to_vec())));
    }
    assert_eq!(got, expected);
}

#[test]
fn the_staged_device_path_reads_a_url_into_its_staging_slots() {
    let bytes = safetensors(TENSORS, 8);
    let server = Server::start(bytes.clone());
    let src = source::open(server.url().as_ref()).unwrap();
    let reader = BlockReader::open(Arc::clone(&src), true).unwrap();
    let device = HostMemoryDevice::new(bytes.len().next_multiple_of(4096));
    let options = StagingOptions { block: 256 << 10, slots: 3 };
    let paths = copy_files(&device, &[StagedFile::whole(&reader, 0)], &options).unwrap();
    assert_eq!(paths, [ReadPath::Remote]);
    assert_eq!(&device.memory()[..bytes.len()], &bytes[..]);
}

#[test]
fn an_object_replaced_after_its_header_was_read_fails_the_load() {
    let bytes = safetensors(TENSORS, 8);
    let server = Server::start(bytes.clone());
    let planned = plan_files(&[PathBuf::from(server.url())]).unwrap();
    let mut other = bytes.clone();
    *other.last_mut().unwrap() ^= 1;
    server.replace(other);
    match planned.read_to_host(&LoadOptions::default()) {
        Err(Error::RemoteChanged { url }) => assert_eq!(url, server.url()),
        other => panic!("expected RemoteChanged, got {:?}", other.map(|l| l.read_paths())),
    }
}

#[test]
fn a_selection_fetches_only_its_ranges_and_a_missing_object_is_named() {
    let bytes = safetensors(TENSORS, 8);
    let server = Server::start(bytes.clone());
    let src = source::open(server.url().as_ref()).unwrap();
    let opened = server.sent.load(Ordering::Relaxed);
    assert!(opened <= bytes.len() as u64, "the first GET asks for at most the object");
    let planned = plan_sources(vec![src]).unwrap();
    let d = planned.tensors.iter().find(|t| t.name == "d").unwrap().clone();
    let selection = Selection::filtered(TensorFilter::new(MatchMode::Exact, &["d"]).unwrap());
    let loaded = planned.select(&selection).unwrap().read_to_host(&LoadOptions::default()).unwrap();
    assert_eq!(loaded.tensors.len(), 1);
    let fetched = server.sent.load(Ordering::Relaxed) - opened;
    // The tensor's bytes, widened to 4 KiB boundaries at each end.
    assert!(fetched >= d.nbytes && fetched <= d.nbytes + 8192, "{fetched} bytes for {}", d.nbytes);

    let missing = server.url().replace("model.safetensors", "other.safetensors");
    match source::open(missing.as_ref()) {
        Err(e @ Error::RemoteNotFound { .. }) => {
            assert!(e.to_string().starts_with(&format!("{missing}: no such object")))
        }
        Err(e) => panic!("expected RemoteNotFound, got {e}"),
        Ok(_) => panic!("a missing object opened"),
    }
}
