//! Files written whole or not at all. Every file the CLI writes (the `--json`, `--junit` and
//! `--html` reports, `export-trace`'s trace) is written to a temporary file in the target's
//! directory, flushed to disk and renamed into place: a reader never sees half a file, and a
//! write that fails leaves the target as it was (absent, or the old file intact) and removes
//! its temporary file. The directory is the target's own because a rename is atomic only within
//! one file system. A process killed mid-write (SIGKILL, or SIGINT, whose default action ends
//! the process at once) can leave its hidden `.NAME.PID.N.tmp` behind, never a partial target.

use crate::error::{Error, Result};
use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Temporary files of one process get distinct names.
static NEXT: AtomicU64 = AtomicU64::new(0);

/// The target's directory, once it is known that a file can be put at `path` (its directory
/// exists, and `path` is not a directory). `what` names the flag or the file in messages.
fn directory(path: &Path, what: &str) -> Result<PathBuf> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if !dir.is_dir() {
        return Err(Error::input(format!(
            "{what} {}: the directory {} does not exist (create it first)",
            path.display(),
            dir.display()
        )));
    }
    if path.is_dir() {
        return Err(Error::input(format!(
            "{what} {} is a directory: give the file to write",
            path.display()
        )));
    }
    Ok(dir)
}

/// A new empty file beside `path`, created exclusively.
fn create_temporary(path: &Path, dir: &Path, what: &str) -> Result<PathBuf> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "out".to_string());
    loop {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let tmp = dir.join(format!(".{name}.{}.{n}.tmp", std::process::id()));
        match OpenOptions::new().write(true).create_new(true).open(&tmp) {
            Ok(_) => return Ok(tmp),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => {
                return Err(Error::input(format!(
                    "{what} {}: cannot write in {}: {e}",
                    path.display(),
                    dir.display()
                )))
            }
        }
    }
}

/// Checks, before the work that produces it, that a file can be written at `path`: its
/// directory exists, `path` is not a directory, and a file can be created beside it (tried,
/// with a temporary file removed at once: permission bits alone do not say so for root or a
/// read-only file system).
pub fn check_target(path: &Path, what: &str) -> Result<()> {
    let dir = directory(path, what)?;
    let tmp = create_temporary(path, &dir, what)?;
    let _ = std::fs::remove_file(&tmp);
    Ok(())
}

/// Calls `write(tmp)` to write the whole file at `tmp`, a temporary path beside `path`, then
/// renames it to `path`. When `write` fails (or the rename does) the temporary file is removed
/// and `path` is untouched. `what` names the flag or the file in messages.
pub fn write_atomically(
    path: &Path,
    what: &str,
    write: impl FnOnce(&Path) -> Result<()>,
) -> Result<()> {
    let dir = directory(path, what)?;
    let tmp = create_temporary(path, &dir, what)?;
    let io =
        |e: std::io::Error| Error::input(format!("{what} {}: cannot write: {e}", path.display()));
    let result = write(&tmp).and_then(|()| {
        File::open(&tmp).and_then(|f| f.sync_all()).map_err(io)?;
        std::fs::rename(&tmp, path).map_err(io)
    });
    if result.is_err() {
        // Nothing to report beyond the error itself: the file may never have been created.
        let _ = std::fs::remove_file(&tmp);
        return result;
    }
    // The rename made durable, where the platform lets a directory be opened and synced.
    if let Ok(d) = File::open(&dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// `contents` written to `path` whole or not at all (see [`write_atomically`]).
pub fn write_file_atomically(path: &Path, what: &str, contents: &[u8]) -> Result<()> {
    write_atomically(path, what, |tmp| {
        std::fs::write(tmp, contents)
            .map_err(|e| Error::input(format!("{what} {}: cannot write: {e}", path.display())))
    })
}

/// Rewrites the header of the safetensors file at `path` with its keys in sorted order, the
/// `__metadata__` entries included, so that the file's bytes are a function of its contents:
/// safetensors serializes `__metadata__` from a `HashMap`, in an order seeded afresh for every
/// map. The header is serialized compactly as safetensors does, so it keeps its length and is
/// overwritten in place.
pub fn sort_safetensors_header(path: &Path) -> Result<()> {
    let internal = |e: &dyn std::fmt::Display| {
        Error::internal(format!("{}: sorting the header: {e}", path.display()))
    };
    let mut f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|e| internal(&e))?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len).map_err(|e| internal(&e))?;
    let n = usize::try_from(u64::from_le_bytes(len)).map_err(|e| internal(&e))?;
    let mut raw = vec![0u8; n];
    f.read_exact(&mut raw).map_err(|e| internal(&e))?;
    // Every key at every level in sorted order: maps are read into BTreeMaps, whatever
    // serde_json's own map keeps.
    let mut header: BTreeMap<String, serde_json::Value> =
        serde_json::from_slice(&raw).map_err(|e| internal(&e))?;
    let meta: Option<BTreeMap<String, String>> = header
        .remove("__metadata__")
        .map(serde_json::from_value)
        .transpose()
        .map_err(|e| internal(&e))?;
    let mut text = String::from("{");
    let mut entries: Vec<String> = Vec::new();
    if let Some(m) = meta {
        entries.push(format!(
            "\"__metadata__\":{}",
            serde_json::to_string(&m).map_err(|e| internal(&e))?
        ));
    }
    for (name, info) in header {
        let info: BTreeMap<String, serde_json::Value> =
            serde_json::from_value(info).map_err(|e| internal(&e))?;
        entries.push(format!(
            "{}:{}",
            serde_json::to_string(&name).map_err(|e| internal(&e))?,
            serde_json::to_string(&info).map_err(|e| internal(&e))?
        ));
    }
    text.push_str(&entries.join(","));
    text.push('}');
    if text.len() > n {
        return Err(internal(&format!(
            "the sorted header has {} bytes, the written one {n}",
            text.len()
        )));
    }
    let mut bytes = text.into_bytes();
    bytes.resize(n, b' ');
    f.seek(SeekFrom::Start(8)).map_err(|e| internal(&e))?;
    f.write_all(&bytes).map_err(|e| internal(&e))?;
    Ok(())
}
