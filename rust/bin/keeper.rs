//! `fastsafetensors-keeper`: the process that keeps loaded weights for later loads.
//!
//! ```text
//! fastsafetensors-keeper --serve [--dir DIR]     in the foreground (a sidecar, a host daemon)
//! fastsafetensors-keeper --spawned --dir DIR     how loads start it: in the background
//! ```
//!
//! With `--serve` its messages go to stderr and it exits only when stopped (`keep --stop`,
//! SIGTERM) unless `FASTSAFETENSORS_KEEP_IDLE` is set; started by a load it goes to the
//! background at once (a session of its own), writes to `DIR/keeper.log`, and exits once it
//! has held nothing for `FASTSAFETENSORS_KEEP_IDLE` seconds (default 300). The directory
//! is `FASTSAFETENSORS_KEEP_DIR`'s unless `--dir` names one; the budget is
//! `FASTSAFETENSORS_KEEP_MEMORY`.

use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::process::ExitCode;

use fastsafetensors::keep::keeper::{self, Lock, Options, Served};
use fastsafetensors::keep::{sys, KEEP_IDLE_ENV, LOG};

fn main() -> ExitCode {
    match run() {
        Ok(code) => code,
        Err(message) => {
            eprintln!("fastsafetensors-keeper: {message}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<ExitCode, String> {
    let mut args = std::env::args().skip(1);
    let (mut serve, mut spawned, mut dir) = (false, false, None);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--serve" => serve = true,
            "--spawned" => spawned = true,
            "--dir" => dir = Some(PathBuf::from(args.next().ok_or("--dir needs a directory")?)),
            "-h" | "--help" => {
                println!("usage: fastsafetensors-keeper --serve [--dir DIR]");
                return Ok(ExitCode::SUCCESS);
            }
            other => {
                return Err(format!("unknown argument '{other}' (usage: fastsafetensors-keeper --serve [--dir DIR])"))
            }
        }
    }
    if serve == spawned {
        return Err("give one of --serve or --spawned".into());
    }
    let mut options = Options::from_env().map_err(|e| e.to_string())?;
    if let Some(dir) = dir {
        options.dir = dir;
    }
    if serve && std::env::var_os(KEEP_IDLE_ENV).is_none_or(|v| v.is_empty()) {
        options.idle = None; // a daemon of its own stays until stopped
    }
    let lock = match Lock::take(&options.dir).map_err(|e| e.to_string())? {
        Ok(lock) => lock,
        // Another keeper won the race: loads talk to it.
        Err(_) if spawned => return Ok(ExitCode::SUCCESS),
        Err(pid) => {
            let who = pid.map_or(String::new(), |p| format!(" (pid {p})"));
            return Err(format!("a keeper{who} already serves {}", options.dir.display()));
        }
    };
    if spawned && !background(&options.dir.join(LOG))? {
        return Ok(ExitCode::SUCCESS); // the process the load started: its work is done
    }
    match keeper::serve_locked(&options, lock).map_err(|e| e.to_string())? {
        Served::Done | Served::AlreadyRunning(_) => Ok(ExitCode::SUCCESS),
    }
}

/// Goes on in a child in a session of its own, its output in `log`: false in the parent
/// (which exits, so that the load that started it can wait for it), true in the child.
fn background(log: &std::path::Path) -> Result<bool, String> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(log)
        .map_err(|e| format!("{}: {e}", log.display()))?;
    // Single-threaded here: no thread has started yet.
    sys::background(&log).map_err(|e| format!("fork failed: {e}"))
}
