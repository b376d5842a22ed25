//! Republishing a stored envelope unchanged (dead-letter replay): the same
//! id, origin and timestamp, appended to its channel after the one
//! validity check every received record passes (envelope.rs).

use crate::engine::Engine;
use crate::envelope::{decode_valid, NameKind, MAX_RECORD_BYTES};
use crate::Error;

/// Appends the envelope `record` (one JSON object) to `channel` as is;
/// returns its id once committed. Refused when it is not a valid envelope
/// or names another channel.
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
    // Stored as one line, whatever the layout of the text given.
    writer.append(env.encode(), 1)?;
    Ok(env.id)
}
