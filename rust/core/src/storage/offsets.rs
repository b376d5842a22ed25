//! Subscriber offset files: `subscribers/<channel>/<id>.offset`, holding the
//! decimal global offset of the next record to deliver and a `\n`.
//!
//! Updates replace the file atomically: write `<id>.offset.tmp`, fsync it,
//! rename it over `<id>.offset`, fsync the directory (the original skipped
//! the directory fsync).

use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use super::{segment, testhook};

/// Extension of offset files.
pub const OFFSET_EXT: &str = ".offset";

/// `data_dir/subscribers/<channel>` (names must already be validated).
pub fn subscribers_dir(data_dir: &Path, channel: &str) -> PathBuf {
    data_dir.join("subscribers").join(channel)
}

/// Path of the offset file of `id` in a subscribers directory.
pub fn offset_path(dir: &Path, id: &str) -> PathBuf {
    dir.join(format!("{id}{OFFSET_EXT}"))
}

/// Reads an offset file. `Ok(None)` when it does not exist; an error when it
/// cannot be read or does not hold a non-negative decimal integer.
pub fn read_offset(path: &Path) -> io::Result<Option<u64>> {
    let text = match fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let value: i64 = text.trim().parse().map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "{} does not hold a decimal offset: {:?}",
                path.display(),
                text.trim()
            ),
        )
    })?;
    u64::try_from(value).map(Some).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{} holds a negative offset {value}", path.display()),
        )
    })
}

/// Atomically replaces the offset file at `path` with `value`.
pub fn write_offset(path: &Path, value: u64) -> io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let result = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o666)
            .open(&tmp)?;
        f.write_all(format!("{value}\n").as_bytes())?;
        f.sync_all()?;
        drop(f);
        testhook::stop_point("offset-tmp");
        fs::rename(&tmp, path)?;
        testhook::entry_changed(path);
        if let Some(dir) = path.parent() {
            segment::sync_dir(dir)?;
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Every `(id, path)` with an offset file in a subscribers directory
/// (federation cursors `fed-*` included); `.tmp` leftovers are ignored.
pub fn list_offsets(dir: &Path) -> io::Result<Vec<(String, PathBuf)>> {
    let mut out = Vec::new();
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(e),
    };
    for entry in entries {
        let entry = entry?;
        let name = entry.file_name();
        if let Some(id) = name.to_str().and_then(|n| n.strip_suffix(OFFSET_EXT)) {
            out.push((id.to_owned(), entry.path()));
        }
    }
    out.sort();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_read_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let p = offset_path(dir.path(), "sub");
        assert_eq!(read_offset(&p).unwrap(), None);
        write_offset(&p, 4286).unwrap();
        assert_eq!(fs::read_to_string(&p).unwrap(), "4286\n");
        assert_eq!(read_offset(&p).unwrap(), Some(4286));
        fs::write(&p, " 17 \n").unwrap();
        assert_eq!(read_offset(&p).unwrap(), Some(17));
        fs::write(&p, "x").unwrap();
        assert!(read_offset(&p).is_err());
        fs::write(&p, "-3").unwrap();
        assert!(read_offset(&p).is_err());
        fs::write(dir.path().join("a.offset.tmp"), "1").unwrap();
        let ids: Vec<_> = list_offsets(dir.path())
            .unwrap()
            .into_iter()
            .map(|(i, _)| i)
            .collect();
        assert_eq!(ids, vec!["sub".to_owned()]);
    }
}
