//! Segment files: naming, discovery, and the small file-system helpers the
//! writer and readers share.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use super::testhook;

/// Width of the zero-padded start offset in a segment's file name.
pub const SEGMENT_NAME_DIGITS: usize = 20;
/// Extension of segment files.
pub const SEGMENT_EXT: &str = ".jsonl";

/// File name of the segment starting at global offset `start`.
pub fn segment_name(start: u64) -> String {
    format!("{start:0width$}{SEGMENT_EXT}", width = SEGMENT_NAME_DIGITS)
}

/// The directory of a data directory that holds one directory per channel.
pub const CHANNELS_DIR: &str = "channels";

/// Parses a segment file name back into its start offset. Like the original,
/// any `<signed 64-bit decimal>.jsonl` counts; negative starts are ignored.
pub fn parse_segment_name(name: &str) -> Option<u64> {
    let stem = name.strip_suffix(SEGMENT_EXT)?;
    stem.parse::<i64>().ok().and_then(|v| u64::try_from(v).ok())
}

#[cfg(test)]
thread_local! {
    /// Directory listings made by this thread ([`list_segments`]), for tests
    /// of how often readers list.
    pub static LISTINGS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Start offsets of every segment in `dir`, ascending. A missing directory
/// has no segments. Only canonical (20-digit) names count; other
/// `<number>.jsonl` files are ignored.
pub fn list_segments(dir: &Path) -> io::Result<Vec<u64>> {
    #[cfg(test)]
    LISTINGS.with(|n| n.set(n.get() + 1));
    let mut starts = Vec::new();
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(starts),
        Err(e) => return Err(e),
    };
    for entry in entries {
        let entry = entry?;
        if entry.file_type()?.is_dir() {
            continue;
        }
        let name = entry.file_name();
        // Segments are opened again by start offset (`segment_path`), so only
        // canonical 20-digit names can be used: a stray `7.jsonl` would be
        // listed but never found, and readers would spin on it forever.
        if let Some(start) = name
            .to_str()
            .and_then(|n| parse_segment_name(n).filter(|&s| segment_name(s) == n))
        {
            starts.push(start);
        }
    }
    starts.sort_unstable();
    Ok(starts)
}

/// Path of the segment starting at `start` in `dir`.
pub fn segment_path(dir: &Path, start: u64) -> PathBuf {
    dir.join(segment_name(start))
}

/// Stream end of a channel directory: start of the last segment plus its size.
pub fn stream_end(dir: &Path) -> io::Result<u64> {
    match list_segments(dir)?.last() {
        None => Ok(0),
        Some(&start) => Ok(start + fs::metadata(segment_path(dir, start))?.len()),
    }
}

/// Creates a new, empty segment (exclusive create, mode 0644 before umask)
/// and fsyncs the directory so the new entry survives a crash.
pub fn create_segment(dir: &Path, start: u64) -> io::Result<File> {
    let path = segment_path(dir, start);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o644)
        .open(&path)?;
    testhook::entry_changed(&path);
    sync_dir(dir)?;
    Ok(file)
}

/// fsyncs a directory (makes created, renamed and deleted entries durable).
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()?;
    testhook::dir_synced(dir);
    Ok(())
}

/// Creates `dir` and its parents with mode 0755 (before umask), fsyncing
/// the parent of each directory it created so the new entries survive a
/// crash (an offset file in a directory whose entry is lost is lost too).
pub fn create_dir_all(dir: &Path) -> io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    let missing: Vec<&Path> = dir
        .ancestors()
        .take_while(|d| !d.as_os_str().is_empty() && !d.exists())
        .collect();
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(dir)?;
    for created in missing.iter().rev() {
        testhook::entry_changed(created);
        match created.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => sync_dir(parent)?,
            _ => sync_dir(Path::new("."))?,
        }
    }
    Ok(())
}

/// Length of the longest prefix of `file` (of length `len`) that ends with a
/// line feed, scanning backwards in blocks.
pub fn last_complete_len(file: &File, len: u64) -> io::Result<u64> {
    use std::os::unix::fs::FileExt;
    const BLOCK: u64 = 64 * 1024;
    let mut buf = vec![0u8; BLOCK as usize];
    let mut end = len;
    while end > 0 {
        let start = end.saturating_sub(BLOCK);
        let chunk = &mut buf[..(end - start) as usize];
        file.read_exact_at(chunk, start)?;
        if let Some(i) = chunk.iter().rposition(|&b| b == b'\n') {
            return Ok(start + i as u64 + 1);
        }
        end = start;
    }
    Ok(0)
}

/// Cuts a torn trailing record (bytes after the last line feed) from the
/// segment `file` at `path`, syncing the cut; returns the length kept.
pub fn repair_tail(file: &File, path: &Path) -> io::Result<u64> {
    let size = file.metadata()?.len();
    let good = last_complete_len(file, size)?;
    if good < size {
        log::warn!(
            "cut {} bytes of a torn trailing record from {}",
            size - good,
            path.display()
        );
        file.set_len(good)?;
        file.sync_all()?;
    }
    Ok(good)
}

/// Repairs the torn tail of the active (last) segment of the channel in
/// `dir`, if it has one.
pub fn repair_channel(dir: &Path) -> io::Result<()> {
    if let Some(&start) = list_segments(dir)?.last() {
        let path = segment_path(dir, start);
        let file = OpenOptions::new().read(true).write(true).open(&path)?;
        repair_tail(&file, &path)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        assert_eq!(segment_name(0), "00000000000000000000.jsonl");
        assert_eq!(segment_name(65536), "00000000000000065536.jsonl");
        assert_eq!(
            parse_segment_name("00000000000000065536.jsonl"),
            Some(65536)
        );
        assert_eq!(parse_segment_name("65536.jsonl"), Some(65536));
        assert_eq!(parse_segment_name("-1.jsonl"), None);
        assert_eq!(parse_segment_name("x.jsonl"), None);
        assert_eq!(parse_segment_name("00000000000000000000.jsonl.tmp"), None);
    }
}
