//! Republishing a stored envelope unchanged (dead-letter replay): the same
//! id, origin and timestamp, appended to its channel after the one
//! validity check every received record passes (envelope.rs).

use std::path::{Component, Path};

use serde::Deserialize;
use serde_json::value::RawValue;

use crate::engine::Engine;
use crate::envelope::{dead_letter_channel, decode_valid, NameKind, MAX_RECORD_BYTES};
use crate::storage::Item;
use crate::Error;

/// Appends the envelope `record` (one JSON object) to `channel` as is;
/// returns its id once committed. Refused when it is not a valid envelope
/// or names another channel. Text on one line is stored byte for byte
/// (fields this version does not know, numbers as written); text over
/// several lines is stored as the envelope read from it, on one line.
pub fn republish(engine: &Engine, channel: &str, record: &[u8]) -> Result<String, Error> {
    let writer = engine.publish_writer(channel)?;
    let env = decode_valid(record, MAX_RECORD_BYTES, NameKind::PublishChannel)
        .map_err(|invalid| Error::from(invalid.error))?;
    if env.channel != channel {
        return Err(Error::Policy(format!(
            "record {} belongs to channel {:?}, not {channel:?}; nothing was replayed",
            env.id, env.channel
        )));
    }
    if record.contains(&b'\n') {
        writer.append(env.encode(), 1)?;
    } else {
        let mut line = Vec::with_capacity(record.len() + 1);
        line.extend_from_slice(record);
        line.push(b'\n');
        writer.append(line, 1)?;
    }
    Ok(env.id)
}

/// The fields of a dead-letter record replay reads, borrowed from its line.
#[derive(Deserialize)]
struct DeadLetter<'a> {
    #[serde(borrow)]
    payload: DeadLetterPayload<'a>,
}

#[derive(Deserialize)]
struct DeadLetterPayload<'a> {
    /// The original envelope, as its text (null when it was too large to
    /// embed or unreadable).
    #[serde(borrow, default)]
    original: Option<&'a RawValue>,
    /// Where the original was copied, relative to the data directory.
    #[serde(default)]
    quarantine_file: Option<String>,
}

/// Replays the dead letter at `offset` of `channel`'s dead-letter channel:
/// appends its original to `channel` byte for byte, as [`republish`] does;
/// an original too large to embed in its dead letter is read from the copy
/// the dead letter names (`quarantine_file`). Returns the original's id.
pub fn replay_dead_letter(engine: &Engine, channel: &str, offset: u64) -> Result<String, Error> {
    let dl_channel = dead_letter_channel(channel);
    let (mut reader, writer) = engine.read_at(&dl_channel, offset)?;
    let next = reader.next_item(writer.committed_end()).map_err(|e| {
        Error::from(crate::StorageError::Io {
            context: format!("reading the dead letter at offset {offset} of {dl_channel:?}"),
            source: std::sync::Arc::new(e),
        })
    })?;
    let line = match next {
        Some(Item::Record {
            offset: at, line, ..
        }) if at == offset => line,
        _ => {
            return Err(Error::Policy(format!(
                "no dead letter of {channel:?} at offset {offset}; nothing was replayed"
            )))
        }
    };
    let not_a_dead_letter = |why: &str| {
        Error::Policy(format!(
            "the record at offset {offset} of {dl_channel:?} {why}; nothing was replayed"
        ))
    };
    let dead_letter: DeadLetter<'_> =
        serde_json::from_slice(&line).map_err(|_| not_a_dead_letter("is not a dead letter"))?;
    let payload = dead_letter.payload;
    if let Some(original) = payload.original {
        return republish(engine, channel, original.get().as_bytes());
    }
    let Some(file) = payload.quarantine_file else {
        return Err(not_a_dead_letter("carries no original"));
    };
    // Only a file under the data directory's quarantine/ may be read.
    let relative = Path::new(&file);
    let inside = relative.starts_with("quarantine")
        && relative
            .components()
            .all(|c| matches!(c, Component::Normal(_)));
    if !inside {
        return Err(not_a_dead_letter(&format!(
            "names {file:?}, not a file under quarantine/"
        )));
    }
    let path = engine.store().data_dir().join(relative);
    let mut copy = std::fs::read(&path).map_err(|e| {
        not_a_dead_letter(&format!(
            "names the copy {}, which cannot be read ({e})",
            path.display()
        ))
    })?;
    if copy.last() == Some(&b'\n') {
        copy.pop();
    }
    republish(engine, channel, &copy)
}
