//! The JSONL envelope: building, encoding, decoding, and name validation.
//! why this file is long: names, ids, timestamps, the record codec and the
//! record rules are one contract (the line format); splitting them would
//! spread that contract over several files.
//!
//! Every record on disk and on the wire is one envelope serialised as a single
//! line of compact JSON with the keys, in order, of keyop-messenger 1.4:
//! `v, id, ts, channel, origin, payload_type, [correlation_id], [service_name], payload`.
//!
//! This module is also the one place where names that become paths (channel
//! names, subscriber ids, peer names) are validated, and where a valid record
//! is defined ([`validate_header`], [`check_payload`],
//! [`decode_valid`]): every way in (local publish, federation, a gateway)
//! applies these rules, so nothing is stored that a reader would refuse.

use std::borrow::Cow;
use std::fmt;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use chrono::DateTime;
use serde_json::value::RawValue;
use uuid::timestamp::context::ContextV7;

mod canonical;

/// Envelope schema version written and accepted.
pub const ENVELOPE_VERSION: u64 = 1;
/// Largest record accepted anywhere, newline included (10 MiB).
pub const MAX_RECORD_BYTES: usize = 10 * 1024 * 1024;
/// Longest name accepted, in bytes.
pub const MAX_NAME_BYTES: usize = 255;
/// Suffix of the dead-letter companion of a channel.
pub const DEAD_LETTER_SUFFIX: &str = ".dead-letter";
/// Payload type of dead-letter envelopes.
pub const DEAD_LETTER_PAYLOAD_TYPE: &str = "com.keyop.messenger.DeadLetterPayload";
/// File-name prefix reserved for hub-side federation cursors.
pub const FED_CURSOR_PREFIX: &str = "fed-";
/// File-name prefix reserved for a client's forwarding cursors.
pub const HUB_CURSOR_PREFIX: &str = "hub-";

/// What a validated name is used for; changes which names are allowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NameKind {
    /// A channel a caller publishes to: `.dead-letter` channels are refused.
    PublishChannel,
    /// Any channel, dead-letter companions included (subscribe, read, store).
    Channel,
    /// A local subscriber id: the `fed-` and `hub-` prefixes are reserved.
    SubscriberId,
    /// A federation peer name (certificate CN) used in cursor file names.
    PeerName,
}

impl fmt::Display for NameKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            NameKind::PublishChannel | NameKind::Channel => "channel name",
            NameKind::SubscriberId => "subscriber id",
            NameKind::PeerName => "peer name",
        })
    }
}

/// A name was refused; `reason` says why and what is allowed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {kind} {name:?}: {reason}")]
pub struct NameError {
    pub kind: NameKind,
    pub name: String,
    pub reason: String,
}

/// Checks a name that will become (part of) a path under `data_dir`.
///
/// Allowed: 1 to [`max_len`] bytes of `A-Z a-z 0-9 . _ -`, not `.` or `..`;
/// peer names may also hold `:`, as certificate CNs of the `host:port` form
/// do (`keyop-messenger keygen --name host:port`, and 1.4's advice). Channel
/// names given to publish must not end in `.dead-letter`; subscriber ids must
/// not start with `fed-` or `hub-` (those names belong to federation cursors).
pub fn validate_name(kind: NameKind, name: &str) -> Result<(), NameError> {
    let fail = |reason: String| {
        Err(NameError {
            kind,
            name: name.to_owned(),
            reason,
        })
    };
    if name.is_empty() {
        return fail("must not be empty".into());
    }
    let max = max_len(kind);
    if name.len() > max {
        return fail(format!(
            "is {} bytes long; at most {max} are allowed",
            name.len()
        ));
    }
    let colon = kind == NameKind::PeerName;
    if let Some(at) = name.bytes().position(|b| {
        !(b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-') || (colon && b == b':'))
    }) {
        let bad = name[at..].chars().next().expect("a character starts here");
        let also = if colon { ", ':'" } else { "" };
        return fail(format!(
            "contains {bad:?}; only letters, digits, '.', '_'{also} and '-' are allowed"
        ));
    }
    if name == "." || name == ".." {
        return fail("'.' and '..' are not allowed".into());
    }
    match kind {
        NameKind::PublishChannel if name.ends_with(DEAD_LETTER_SUFFIX) => fail(format!(
            "'{DEAD_LETTER_SUFFIX}' channels are written only by the dead-letter mechanism"
        )),
        NameKind::SubscriberId
            if name.starts_with(FED_CURSOR_PREFIX) || name.starts_with(HUB_CURSOR_PREFIX) =>
        {
            fail(format!(
                "ids starting with '{FED_CURSOR_PREFIX}' or '{HUB_CURSOR_PREFIX}' are reserved for federation cursors"
            ))
        }
        _ => Ok(()),
    }
}

/// Longest name of a kind, so that every file name derived from it fits the
/// 255-byte limit of file systems: a publishable channel leaves room for its
/// `.dead-letter` companion, a subscriber id for `.offset.tmp`, a peer name
/// for `fed-` and `.offset.tmp`.
pub fn max_len(kind: NameKind) -> usize {
    const TMP_OFFSET: usize = ".offset.tmp".len();
    match kind {
        NameKind::Channel => MAX_NAME_BYTES,
        NameKind::PublishChannel => MAX_NAME_BYTES - DEAD_LETTER_SUFFIX.len(),
        NameKind::SubscriberId => MAX_NAME_BYTES - TMP_OFFSET,
        NameKind::PeerName => MAX_NAME_BYTES - FED_CURSOR_PREFIX.len() - TMP_OFFSET,
    }
}

/// Deepest nesting of arrays and objects accepted in a payload (`[[1]]` is 2).
///
/// Every reader in this package decodes payloads with serde_json, whose
/// default recursion limit is 128 levels for the whole value; a record's
/// payload sits one level inside the envelope and three inside a dead letter
/// (`{"original":{..,"payload":..}}` as the payload of another envelope), so
/// 100 leaves every reader room. Go 1.4 readers accept 10000 levels.
pub const MAX_PAYLOAD_DEPTH: usize = 100;
/// Most digits of an integer in a record: Python's default limit on
/// converting between `int` and text (`sys.get_int_max_str_digits()`), so
/// every Python reader can read what is stored.
pub const MAX_INTEGER_DIGITS: usize = 4300;
/// Longest message id accepted, in bytes. 1.4 writes 36-byte UUIDs.
pub const MAX_ID_BYTES: usize = 64;
/// Longest `origin`, `payload_type`, `service_name` or `correlation_id`, in bytes.
pub const MAX_FIELD_BYTES: usize = 255;

/// Why a record is not valid; nothing of it is stored. Names and ids in the
/// message are cut short, so a hostile 9 MiB id is never echoed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    /// Larger than the receiver accepts (bytes of JSON, without newline).
    #[error("record is {size} bytes; the limit is {limit} bytes")]
    TooLarge { size: usize, limit: usize },
    /// Not a readable envelope (JSON, version, timestamp).
    #[error("unreadable record: {0}")]
    Unreadable(String),
    /// The payload nests arrays/objects deeper than [`MAX_PAYLOAD_DEPTH`].
    #[error("payload is nested deeper than {MAX_PAYLOAD_DEPTH} levels of arrays and objects")]
    TooDeep,
    /// A value no reader can hold: a string escape that is half of a UTF-16
    /// surrogate pair, a number beyond a double's range, or an integer of
    /// more than [`MAX_INTEGER_DIGITS`] digits.
    #[error("unreadable value: {0}")]
    BadValue(&'static str),
    /// A field breaks its rule; `reason` says what is allowed.
    #[error("invalid {field} {value}: {reason}")]
    Field {
        field: &'static str,
        /// The value, quoted and cut to 40 characters.
        value: String,
        reason: String,
    },
}

/// `text` quoted for a message, cut to 40 characters.
fn shorten(text: &str) -> String {
    let mut chars = text.chars();
    let head: String = chars.by_ref().take(40).collect();
    if chars.next().is_some() {
        format!("{head:?}... ({} bytes)", text.len())
    } else {
        format!("{head:?}")
    }
}

fn field_error(field: &'static str, value: &str, reason: String) -> RecordError {
    RecordError::Field {
        field,
        value: shorten(value),
        reason,
    }
}

/// Checks a message id: 1 to [`MAX_ID_BYTES`] bytes of `A-Z a-z 0-9 - _ . :`
/// (a UUID, ULID or prefixed id fits; 1.4 writes lowercase UUIDv7 text).
pub fn validate_id(id: &str) -> Result<(), RecordError> {
    if id.is_empty() {
        return Err(field_error("id", id, "must not be empty".into()));
    }
    if id.len() > MAX_ID_BYTES {
        return Err(field_error(
            "id",
            id,
            format!("at most {MAX_ID_BYTES} bytes are allowed"),
        ));
    }
    if !id.bytes().all(|b| ID_BYTES[usize::from(b)]) {
        return Err(field_error(
            "id",
            id,
            "only letters, digits, '-', '_', '.' and ':' are allowed".into(),
        ));
    }
    Ok(())
}

/// The bytes an id may hold (see [`validate_id`]), as a table: ids are
/// checked on every record written or received.
static ID_BYTES: [bool; 256] = {
    let mut t = [false; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        t[b] = c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.' | b':');
        b += 1;
    }
    t
};

/// Checks a free-text header field (`origin`, `payload_type`,
/// `service_name`, `correlation_id`): at most [`MAX_FIELD_BYTES`] bytes, no
/// control characters (they would forge log and audit lines). May be empty.
pub fn validate_field(field: &'static str, value: &str) -> Result<(), RecordError> {
    if value.len() > MAX_FIELD_BYTES {
        return Err(field_error(
            field,
            value,
            format!("at most {MAX_FIELD_BYTES} bytes are allowed"),
        ));
    }
    // Printable ASCII (the usual case) has no control character; anything
    // else is checked by character (C1 controls are two bytes in UTF-8).
    let printable = value.bytes().all(|b| (0x20..0x7f).contains(&b));
    if !printable && value.chars().any(char::is_control) {
        return Err(field_error(
            field,
            value,
            "control characters are not allowed".into(),
        ));
    }
    Ok(())
}

/// Checks every header field of a record about to be written: the id, the
/// channel (as `kind`) and the free-text fields. The timestamp is checked by
/// [`Envelope::decode`] (received records) or made here ([`Stamp`]).
pub fn validate_header(h: &Header<'_>, kind: NameKind) -> Result<(), RecordError> {
    validate_id(h.id)?;
    validate_name(kind, h.channel).map_err(|e| field_error("channel", h.channel, e.reason))?;
    validate_field("origin", h.origin)?;
    validate_field("payload_type", h.payload_type)?;
    validate_field("service_name", h.service_name.unwrap_or(""))?;
    validate_field("correlation_id", h.correlation_id.unwrap_or(""))?;
    Ok(())
}

/// Checks that the JSON text `json` nests arrays and objects at most
/// [`MAX_PAYLOAD_DEPTH`] deep. One pass over the bytes, no recursion; the
/// text must be valid JSON (strings are skipped by their quotes). The rule
/// readers apply to stored records; a record written or received must also
/// pass [`check_payload`].
pub fn check_payload_depth(json: &[u8]) -> Result<(), RecordError> {
    // Each level needs at least two bytes: shorter texts cannot be too deep.
    if json.len() <= 2 * MAX_PAYLOAD_DEPTH {
        return Ok(());
    }
    scan_json(json, MAX_PAYLOAD_DEPTH, false)
}

/// Checks a payload about to be stored: [`check_payload_depth`], and that
/// every value can be read back ([`RecordError::BadValue`]): no lone UTF-16
/// surrogate in a `\u` escape, no number that overflows a double, no integer
/// of more than [`MAX_INTEGER_DIGITS`] digits. Such JSON is well formed, yet
/// Python cannot read it (or print it), so it is refused at every way in
/// rather than stored, acknowledged and then dead-lettered by its readers.
pub fn check_payload(json: &[u8]) -> Result<(), RecordError> {
    // The usual payload passes without a walk over its strings: too short
    // to nest too deep or to hold a number of 309 digits, and with no
    // escape and no exponent, it holds no value that could be refused.
    let plain = json.len() <= 2 * MAX_PAYLOAD_DEPTH
        && memchr::memchr(b'\\', json).is_none()
        && !memchr::memchr2_iter(b'e', b'E', json)
            .any(|at| at > 0 && matches!(json[at - 1], b'0'..=b'9' | b'.'));
    if plain {
        return Ok(());
    }
    scan_json(json, MAX_PAYLOAD_DEPTH, true)
}

/// One pass over valid JSON text: nesting at most `max_depth`, and with
/// `values`, the checks of [`check_payload`].
fn scan_json(json: &[u8], max_depth: usize, values: bool) -> Result<(), RecordError> {
    let mut depth = 0usize;
    let mut i = 0;
    loop {
        let next = memchr::memchr3(b'"', b'[', b'{', &json[i..]).map(|at| i + at);
        let between = &json[i..next.unwrap_or(json.len())];
        if values {
            check_numbers(between)?;
        }
        let Some(at) = next else { return Ok(()) };
        // Closers between `i` and `at` lower the depth.
        depth = depth.saturating_sub(between.iter().filter(|&&b| b == b']' || b == b'}').count());
        if json[at] == b'"' {
            // Skip the string: find the closing quote not escaped.
            let mut j = at + 1;
            loop {
                match memchr::memchr2(b'"', b'\\', &json[j..]) {
                    Some(k) if json[j + k] == b'\\' => {
                        let esc = j + k;
                        if values && json.get(esc + 1) == Some(&b'u') {
                            check_surrogate(json, esc)?;
                        }
                        j = esc + 2;
                    }
                    Some(k) => {
                        j += k + 1;
                        break;
                    }
                    None => return Ok(()),
                }
                if j >= json.len() {
                    return Ok(());
                }
            }
            i = j.min(json.len());
        } else {
            depth += 1;
            if depth > max_depth {
                return Err(RecordError::TooDeep);
            }
            i = at + 1;
        }
    }
}

/// The code unit of the `\uXXXX` escape at `json[at..]`, if it is one.
fn escape_unit(json: &[u8], at: usize) -> Option<u16> {
    let hex = json.get(at..at + 6)?;
    if &hex[..2] != b"\\u" {
        return None;
    }
    u16::from_str_radix(std::str::from_utf8(&hex[2..]).ok()?, 16).ok()
}

/// The `\u` escape at `json[esc..]` is not half of a surrogate pair: a high
/// surrogate must be followed at once by an escaped low one, which pairs
/// with it (and is then skipped as the ordinary escape it also is).
fn check_surrogate(json: &[u8], esc: usize) -> Result<(), RecordError> {
    const LONE: RecordError = RecordError::BadValue("a \\u escape of half a surrogate pair");
    match escape_unit(json, esc) {
        Some(0xD800..=0xDBFF) => match escape_unit(json, esc + 6) {
            Some(0xDC00..=0xDFFF) => Ok(()),
            _ => Err(LONE),
        },
        Some(0xDC00..=0xDFFF) => {
            // Fine only as the second half of a pair that starts just before.
            match esc.checked_sub(6).and_then(|h| escape_unit(json, h)) {
                Some(0xD800..=0xDBFF) if !escaped_at(json, esc - 6) => Ok(()),
                _ => Err(LONE),
            }
        }
        _ => Ok(()),
    }
}

/// Whether the backslash at `json[at]` is itself escaped (preceded by an
/// odd number of backslashes).
fn escaped_at(json: &[u8], at: usize) -> bool {
    json[..at].iter().rev().take_while(|&&b| b == b'\\').count() % 2 == 1
}

/// Checks the numbers in `text`, JSON outside any string: a number with a
/// fraction or an exponent must be a finite double; an integer has at most
/// [`MAX_INTEGER_DIGITS`] digits. Short texts without an exponent are
/// passed without a look at each token (the common case: a few small
/// numbers, `true`, `null`).
fn check_numbers(text: &[u8]) -> Result<(), RecordError> {
    // Without an exponent, a number overflows a double only past 308 digits.
    if text.len() <= 308 && memchr::memchr2(b'e', b'E', text).is_none() {
        return Ok(());
    }
    let tokens = text.split(|b| {
        matches!(
            b,
            b',' | b':' | b'[' | b']' | b'{' | b'}' | b' ' | b'\t' | b'\r' | b'\n'
        )
    });
    for token in tokens {
        let Some(&first) = token.first() else {
            continue;
        };
        if first != b'-' && !first.is_ascii_digit() {
            continue; // true, false, null
        }
        let integer = !token.iter().any(|b| matches!(b, b'.' | b'e' | b'E'));
        if integer {
            let digits = token.len() - usize::from(first == b'-');
            if digits > MAX_INTEGER_DIGITS {
                return Err(RecordError::BadValue("an integer of more than 4300 digits"));
            }
        } else if token.len() > 308 || token.iter().any(|b| matches!(b, b'e' | b'E')) {
            let finite = std::str::from_utf8(token)
                .ok()
                .and_then(|t| t.parse::<f64>().ok())
                .is_some_and(f64::is_finite);
            if !finite {
                return Err(RecordError::BadValue("a number beyond a double's range"));
            }
        }
    }
    Ok(())
}

/// A received record that is not valid: why, and what of it may be echoed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invalid {
    pub error: RecordError,
    /// The record's id when it parsed and is itself valid, else empty.
    pub id: String,
    /// The record's channel when it parsed and is a valid name, else empty.
    pub channel: String,
}

/// Decodes a received record and applies every rule of a valid record:
/// size (`limit` bytes of JSON), readability, header fields (the channel as
/// `kind`), and the nesting and values of the whole record
/// ([`check_payload`]'s rule). On error only a valid id and a valid channel
/// name are kept (so a refusal can name them; an invalid one is never echoed).
pub fn decode_valid(rec: &[u8], limit: usize, kind: NameKind) -> Result<Envelope, Box<Invalid>> {
    decode_checked(rec, limit, kind)
}

/// [`decode_valid`], borrowing the fields from `rec` (a receiver that
/// keeps only the id and channel of each record copies nothing else).
pub fn decode_valid_ref(
    rec: &[u8],
    limit: usize,
    kind: NameKind,
) -> Result<EnvelopeRef<'_>, Box<Invalid>> {
    decode_checked(rec, limit, kind)
}

/// An envelope as [`decode_valid`] and [`decode_valid_ref`] check it.
trait Checked<'a>: Sized {
    /// The envelope, and whether the line has the canonical layout (only the
    /// envelope's keys, header strings without escapes).
    fn decode(line: &'a [u8]) -> Result<(Self, bool), DecodeError>;
    fn header(&self) -> Header<'_>;
    fn payload(&self) -> &str;
    fn into_id_channel(self) -> (String, String);
}

impl<'a> Checked<'a> for Envelope {
    fn decode(line: &'a [u8]) -> Result<(Self, bool), DecodeError> {
        Ok((Envelope::decode(line)?, false))
    }
    fn header(&self) -> Header<'_> {
        Envelope::header(self)
    }
    fn payload(&self) -> &str {
        self.payload.get()
    }
    fn into_id_channel(self) -> (String, String) {
        (self.id, self.channel)
    }
}

impl<'a> Checked<'a> for EnvelopeRef<'a> {
    fn decode(line: &'a [u8]) -> Result<(Self, bool), DecodeError> {
        match canonical::decode(line) {
            Some(e) => Ok((e, true)),
            None => Ok((decode_full(line)?, false)),
        }
    }
    fn header(&self) -> Header<'_> {
        EnvelopeRef::header(self)
    }
    fn payload(&self) -> &str {
        &self.payload
    }
    fn into_id_channel(self) -> (String, String) {
        (self.id.into_owned(), self.channel.into_owned())
    }
}

fn decode_checked<'a, E: Checked<'a>>(
    rec: &'a [u8],
    limit: usize,
    kind: NameKind,
) -> Result<E, Box<Invalid>> {
    let invalid = |error: RecordError, env: Option<E>| {
        // A record that does not decode may still start as every writer
        // starts one: its id and channel then name it in the refusal.
        let (mut id, mut channel) = env.map(E::into_id_channel).unwrap_or_else(|| {
            canonical::leading_fields(rec)
                .map(|(id, channel, _)| (id.to_owned(), channel.to_owned()))
                .unwrap_or_default()
        });
        if validate_id(&id).is_err() {
            id.clear();
        }
        if validate_name(NameKind::Channel, &channel).is_err() {
            channel.clear();
        }
        Box::new(Invalid { error, id, channel })
    };
    if rec.len() > limit {
        let error = RecordError::TooLarge {
            size: rec.len(),
            limit,
        };
        return Err(invalid(error, E::decode(rec).ok().map(|(env, _)| env)));
    }
    let (env, canonical) = match E::decode(rec) {
        Ok(decoded) => decoded,
        // A decode error may quote a value of any length: keep 200 characters.
        Err(e) => {
            let text: String = e.to_string().chars().take(200).collect();
            return Err(invalid(RecordError::Unreadable(text), None));
        }
    };
    // The whole record, not only its payload: keys other than the
    // envelope's are stored as received (and relayed), so their values obey
    // the same rule (one level deeper, inside the envelope's object). A
    // line in the canonical layout has no other key, and header strings
    // without escapes: its payload is all there is to check.
    let checked = validate_header(&env.header(), kind).and_then(|()| match canonical {
        true => check_payload(env.payload().as_bytes()),
        false => scan_json(rec, MAX_PAYLOAD_DEPTH + 1, true),
    });
    match checked {
        Ok(()) => Ok(env),
        Err(e) => Err(invalid(e, Some(env))),
    }
}

/// The dead-letter companion of `channel`.
pub fn dead_letter_channel(channel: &str) -> String {
    format!("{channel}{DEAD_LETTER_SUFFIX}")
}

/// The UUIDv7 clock sequence of this process: ids are monotonic within it.
/// Tagged with the fork generation it belongs to: a forked child starts a
/// fresh one (the parent's copy could be locked by a thread the child does
/// not have, and would repeat the parent's sequence).
struct V7Context {
    generation: u64,
    context: Mutex<ContextV7>,
}

static V7_CONTEXT: AtomicPtr<V7Context> = AtomicPtr::new(std::ptr::null_mut());

/// The clock sequence of this process (created on first use, and again in
/// each forked child; the few bytes of a replaced one are never freed).
fn v7_context() -> &'static V7Context {
    let generation = crate::fork::generation();
    let current = V7_CONTEXT.load(Ordering::Acquire);
    // SAFETY: every pointer stored is a leaked Box, never freed.
    if let Some(ctx) = unsafe { current.as_ref() } {
        if ctx.generation == generation {
            return ctx;
        }
    }
    let fresh = Box::into_raw(Box::new(V7Context {
        generation,
        context: Mutex::new(ContextV7::new()),
    }));
    match V7_CONTEXT.compare_exchange(current, fresh, Ordering::AcqRel, Ordering::Acquire) {
        // SAFETY: just leaked above.
        Ok(_) => unsafe { &*fresh },
        Err(winner) => {
            // SAFETY: ours was never shared; the winner is a leaked Box.
            drop(unsafe { Box::from_raw(fresh) });
            unsafe { &*winner }
        }
    }
}

/// A fresh message id and its timestamp, taken from one clock reading.
///
/// Both live on the stack: building them allocates nothing.
#[derive(Clone, Copy)]
pub struct Stamp {
    id: [u8; 36],
    ts: TsBuf,
}

impl Stamp {
    /// An id and timestamp for a message created now.
    pub fn now() -> Stamp {
        let since = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let (secs, nanos) = (since.as_secs(), since.subsec_nanos());
        // After a fork the child's copy of this thread's generator would
        // repeat the parent's numbers: reseed it first.
        crate::fork::reseed_rng_after_fork();
        let ts = uuid::Timestamp::from_unix(&v7_context().context, secs, nanos);
        let mut id = [0u8; 36];
        uuid::Uuid::new_v7(ts).hyphenated().encode_lower(&mut id);
        Stamp {
            id,
            ts: TsBuf::new(secs, nanos),
        }
    }

    /// The UUIDv7 in canonical lowercase form.
    pub fn id(&self) -> &str {
        std::str::from_utf8(&self.id).expect("a hyphenated UUID is ASCII")
    }

    /// The RFC 3339 timestamp, as [`format_ts`] writes it.
    pub fn ts(&self) -> &str {
        self.ts.as_str()
    }
}

/// A new message id: a UUIDv7 in canonical lowercase form (monotonic within the process).
pub fn new_id() -> String {
    Stamp::now().id().to_owned()
}

/// Formats a time as keyop-messenger 1.4 does: RFC 3339 in UTC, up to nine
/// fraction digits with trailing zeros trimmed (no dot for a whole second).
/// Times before 1970 are clamped to the epoch (no clock reading is).
pub fn format_ts(t: SystemTime) -> String {
    let since = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    TsBuf::new(since.as_secs(), since.subsec_nanos())
        .as_str()
        .to_owned()
}

/// The current time as a record's `ts` ([`format_ts`]): for records whose
/// ids are given, which need no new id.
pub fn ts_now() -> TsBuf {
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    TsBuf::new(since.as_secs(), since.subsec_nanos())
}

/// A formatted timestamp: `YYYY-MM-DDTHH:MM:SS[.fraction]Z`, at most 30 bytes.
#[derive(Clone, Copy)]
pub struct TsBuf {
    buf: [u8; 30],
    len: u8,
}

impl TsBuf {
    fn new(secs: u64, nanos: u32) -> TsBuf {
        fn put(buf: &mut [u8], mut v: u64) {
            for slot in buf.iter_mut().rev() {
                *slot = b'0' + (v % 10) as u8;
                v /= 10;
            }
        }
        let (days, sod) = (secs / 86_400, secs % 86_400);
        let (year, month, day) = civil_from_days(days);
        let mut buf = *b"0000-00-00T00:00:00.000000000Z";
        // Years past 9999 cannot come from a clock; clamp rather than emit a
        // malformed timestamp.
        put(&mut buf[0..4], year.min(9999));
        put(&mut buf[5..7], month);
        put(&mut buf[8..10], day);
        put(&mut buf[11..13], sod / 3600);
        put(&mut buf[14..16], sod / 60 % 60);
        put(&mut buf[17..19], sod % 60);
        // Leap-second nanos (>= 1e9) are folded into the last representable value.
        let mut nanos = nanos.min(999_999_999);
        let mut len = 19;
        if nanos != 0 {
            let mut width = 9;
            while nanos % 10 == 0 {
                nanos /= 10;
                width -= 1;
            }
            put(&mut buf[20..20 + width], u64::from(nanos));
            len = 20 + width;
        }
        buf[len] = b'Z';
        TsBuf {
            buf,
            len: (len + 1) as u8,
        }
    }

    /// The timestamp's text.
    pub fn as_str(&self) -> &str {
        std::str::from_utf8(&self.buf[..usize::from(self.len)]).expect("ASCII timestamp")
    }
}

/// Year, month and day of the proleptic Gregorian calendar for a count of
/// days since 1970-01-01 (H. Hinnant's `civil_from_days`, for days >= 0).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

/// Parses an RFC 3339 timestamp (any offset, 0-9 fraction digits) into
/// nanoseconds since the Unix epoch. `None` when it does not parse.
pub fn parse_ts_nanos(ts: &str) -> Option<i64> {
    parse_utc_ts(ts.as_bytes()).or_else(|| {
        DateTime::parse_from_rfc3339(ts)
            .ok()
            .and_then(|d| d.timestamp_nanos_opt())
    })
}

/// The form every writer of the format produces, `YYYY-MM-DDTHH:MM:SS[.f]Z`
/// from 1970 on, parsed without the general RFC 3339 parser; `None` for
/// anything else (which the general parser then handles or refuses).
fn parse_utc_ts(b: &[u8]) -> Option<i64> {
    fn num(b: &[u8]) -> Option<u64> {
        b.iter().try_fold(0u64, |acc, &c| {
            c.is_ascii_digit().then(|| acc * 10 + u64::from(c - b'0'))
        })
    }
    if b.len() < 20
        || b[b.len() - 1] != b'Z'
        || b[4] != b'-'
        || b[7] != b'-'
        || b[10] != b'T'
        || b[13] != b':'
        || b[16] != b':'
    {
        return None;
    }
    let (year, month, day) = (num(&b[0..4])?, num(&b[5..7])?, num(&b[8..10])?);
    let (hour, minute, second) = (num(&b[11..13])?, num(&b[14..16])?, num(&b[17..19])?);
    let days_in_month = match month {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if year % 4 == 0 && (year % 100 != 0 || year % 400 == 0) => 29,
        2 => 28,
        _ => return None,
    };
    // Leap seconds (:60) are left to the general parser.
    if year < 1970 || day == 0 || day > days_in_month || hour > 23 || minute > 59 || second > 59 {
        return None;
    }
    let nanos = match &b[19..b.len() - 1] {
        [] => 0,
        [b'.', frac @ ..] if (1..=9).contains(&frac.len()) => {
            num(frac)? * 10u64.pow(9 - frac.len() as u32)
        }
        _ => return None,
    };
    let secs = days_from_civil(year, month, day) * 86_400 + hour * 3600 + minute * 60 + second;
    i64::try_from(secs.checked_mul(1_000_000_000)?.checked_add(nanos)?).ok()
}

/// Days since 1970-01-01 of a proleptic Gregorian date from 1970 on (the
/// inverse of [`civil_from_days`]).
fn days_from_civil(year: u64, month: u64, day: u64) -> u64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y / 400;
    let yoe = y - era * 400;
    let mp = if month > 2 { month - 3 } else { month + 9 };
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The fields of an envelope other than the payload, as the publisher sets them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header<'a> {
    pub id: &'a str,
    pub ts: &'a str,
    pub channel: &'a str,
    pub origin: &'a str,
    pub payload_type: &'a str,
    /// Omitted from the line when `None` or empty.
    pub correlation_id: Option<&'a str>,
    /// Omitted from the line when `None` or empty.
    pub service_name: Option<&'a str>,
}

/// Appends `s` as a JSON string, escaped exactly as serde_json escapes it.
///
/// Most strings need no escaping (names, ids, timestamps, plain text); they
/// are copied in one go.
pub fn push_json_str(out: &mut Vec<u8>, s: &str) {
    if !needs_escape(s.as_bytes()) {
        out.reserve(s.len() + 2);
        out.push(b'"');
        out.extend_from_slice(s.as_bytes());
        out.push(b'"');
    } else {
        // Writing into a Vec cannot fail, and a &str always serialises.
        serde_json::to_writer(&mut *out, s).expect("string serialisation into a Vec");
    }
}

/// Whether any byte of `b` is a control character, `"` or `\\`: the bytes
/// JSON strings must escape. Checks eight bytes at a time.
fn needs_escape(b: &[u8]) -> bool {
    const ONES: u64 = u64::from_ne_bytes([0x01; 8]);
    const HIGH: u64 = u64::from_ne_bytes([0x80; 8]);
    // Exact per word: a high bit is set for some byte iff that byte is zero
    // (`zero`) or below 0x20 (`below`); bytes >= 0x80 never count.
    let zero = |v: u64| v.wrapping_sub(ONES) & !v & HIGH;
    let below = |v: u64| v.wrapping_sub(ONES * 0x20) & !v & HIGH;
    let mut words = b.chunks_exact(8);
    for w in &mut words {
        let v = u64::from_ne_bytes(w.try_into().expect("eight bytes"));
        if below(v) | zero(v ^ (ONES * u64::from(b'"'))) | zero(v ^ (ONES * u64::from(b'\\'))) != 0
        {
            return true;
        }
    }
    words
        .remainder()
        .iter()
        .any(|&c| c < 0x20 || c == b'"' || c == b'\\')
}

/// Appends one record (the envelope's JSON and its `\n`) to `out`.
///
/// `payload_json` must be one compact JSON value without raw line feeds (as
/// produced by serde_json or the binding's encoder); it is copied verbatim.
pub fn encode_record(out: &mut Vec<u8>, h: &Header<'_>, payload_json: &[u8]) {
    encode_record_head(out, h);
    out.extend_from_slice(payload_json);
    out.extend_from_slice(RECORD_TAIL);
}

/// What ends a record after its payload (see [`encode_record`]).
pub const RECORD_TAIL: &[u8] = b"}\n";

/// The start of a record, up to and including `"payload":` (see
/// [`encode_record`]): a payload and [`RECORD_TAIL`] complete it.
pub fn encode_record_head(out: &mut Vec<u8>, h: &Header<'_>) {
    encode_record_id(out, h.id);
    encode_record_after_id(out, h);
}

/// The start of a record up to and including its id (see [`encode_record_head`]).
pub fn encode_record_id(out: &mut Vec<u8>, id: &str) {
    out.extend_from_slice(b"{\"v\":1,\"id\":");
    push_json_str(out, id);
}

/// What follows a record's id up to and including `"payload":` (see
/// [`encode_record_head`]): the same for records that differ only in id.
pub fn encode_record_after_id(out: &mut Vec<u8>, h: &Header<'_>) {
    out.extend_from_slice(b",\"ts\":");
    push_json_str(out, h.ts);
    out.extend_from_slice(b",\"channel\":");
    push_json_str(out, h.channel);
    out.extend_from_slice(b",\"origin\":");
    push_json_str(out, h.origin);
    out.extend_from_slice(b",\"payload_type\":");
    push_json_str(out, h.payload_type);
    if let Some(c) = h.correlation_id.filter(|c| !c.is_empty()) {
        out.extend_from_slice(b",\"correlation_id\":");
        push_json_str(out, c);
    }
    if let Some(s) = h.service_name.filter(|s| !s.is_empty()) {
        out.extend_from_slice(b",\"service_name\":");
        push_json_str(out, s);
    }
    out.extend_from_slice(b",\"payload\":");
}

/// Why a stored line is not a readable envelope (the reader skips such lines).
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("not a JSON envelope: {0}")]
    Json(#[from] serde_json::Error),
    #[error("unsupported envelope version {0}")]
    Version(String),
    #[error("timestamp {0:?} is not RFC 3339")]
    Timestamp(String),
}

/// A decoded envelope; the payload is kept as raw JSON text.
#[derive(Debug, Clone)]
pub struct Envelope {
    pub id: String,
    pub ts: String,
    /// `ts` as nanoseconds since the Unix epoch.
    pub ts_nanos: i64,
    pub channel: String,
    pub origin: String,
    pub payload_type: String,
    pub correlation_id: Option<String>,
    pub service_name: Option<String>,
    /// Never holds a raw `\n` or `\r` when decoded.
    pub payload: Box<RawValue>,
}

/// An envelope decoded without copying its fields out of the line
/// ([`EnvelopeRef::decode`]; [`Envelope::decode`] owns them, by the same
/// rules): for readers that copy the fields elsewhere at once.
pub struct EnvelopeRef<'a> {
    pub id: Cow<'a, str>,
    pub ts: Cow<'a, str>,
    /// `ts` as nanoseconds since the Unix epoch.
    pub ts_nanos: i64,
    pub channel: Cow<'a, str>,
    pub origin: Cow<'a, str>,
    pub payload_type: Cow<'a, str>,
    pub correlation_id: Option<Cow<'a, str>>,
    pub service_name: Option<Cow<'a, str>>,
    /// The payload's JSON text; never holds a raw `\n` or `\r`.
    pub payload: Cow<'a, str>,
}

/// A record's fields as read; `P` holds the payload (owned or borrowed).
#[derive(serde::Deserialize)]
struct Wire<'a, P> {
    #[serde(default)]
    v: Option<serde_json::Number>,
    #[serde(default, borrow)]
    id: Cow<'a, str>,
    #[serde(default, borrow)]
    ts: Cow<'a, str>,
    #[serde(default, borrow)]
    channel: Cow<'a, str>,
    #[serde(default, borrow)]
    origin: Cow<'a, str>,
    #[serde(default, borrow)]
    payload_type: Cow<'a, str>,
    #[serde(default, borrow)]
    correlation_id: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    service_name: Option<Cow<'a, str>>,
    payload: Option<P>,
}

/// The reader rules of keyop-messenger 1.4 (see [`Envelope::decode`]): the
/// fields of `line` and its timestamp in nanoseconds.
fn decode_wire<'a, P: serde::Deserialize<'a>>(
    line: &'a [u8],
) -> Result<(Wire<'a, P>, i64), DecodeError> {
    // One UTF-8 check of the whole line is much cheaper than one per
    // string; a line with stray non-UTF-8 bytes gets the per-string rules.
    // A JSON array would fill the fields by position (serde accepts both
    // forms for a struct); 1.4 readers accept objects only.
    if line.trim_ascii_start().first() != Some(&b'{') {
        return Err(DecodeError::Json(serde::de::Error::custom(
            "an envelope must be a JSON object",
        )));
    }
    let w: Wire<'a, P> = match std::str::from_utf8(line) {
        Ok(text) => serde_json::from_str(text)?,
        Err(_) => serde_json::from_slice(line)?,
    };
    match &w.v {
        Some(n) if n.as_u64() == Some(ENVELOPE_VERSION) => {}
        other => {
            return Err(DecodeError::Version(
                other.as_ref().map_or("(missing)".into(), |n| n.to_string()),
            ))
        }
    }
    let ts_nanos = parse_ts_nanos(&w.ts).ok_or_else(|| DecodeError::Timestamp(w.ts.to_string()))?;
    Ok((w, ts_nanos))
}

/// A raw line break in valid JSON can only be whitespace between tokens
/// (strings hold them escaped). Kept, it would split the record
/// [`Envelope::encode`] makes of a payload into several lines.
fn has_line_break(json: &str) -> bool {
    memchr::memchr2(b'\n', b'\r', json.as_bytes()).is_some()
}

/// An optional text field: absent when missing or empty.
fn non_empty(field: Option<Cow<'_, str>>) -> Option<Cow<'_, str>> {
    field.filter(|c| !c.is_empty())
}

/// The [`Header`] of an envelope, owned ([`Envelope`]) or borrowed
/// ([`EnvelopeRef`]): their fields deref to the same `str`s.
macro_rules! header_of {
    ($e:expr) => {
        Header {
            id: &$e.id,
            ts: &$e.ts,
            channel: &$e.channel,
            origin: &$e.origin,
            payload_type: &$e.payload_type,
            correlation_id: $e.correlation_id.as_deref(),
            service_name: $e.service_name.as_deref(),
        }
    };
}

impl<'a> EnvelopeRef<'a> {
    /// The header fields, as [`encode_record`] takes them.
    pub fn header(&self) -> Header<'_> {
        header_of!(self)
    }

    /// This envelope as one record line (with `\n`), as [`Envelope::encode`]
    /// makes it.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(160 + self.payload.len());
        encode_record(&mut out, &self.header(), self.payload.as_bytes());
        out
    }

    /// Decodes one line (without its `\n`) as [`Envelope::decode`] does,
    /// borrowing what needs no unescaping. A line in the layout every writer
    /// produces is read without a JSON parser over its header (the
    /// `canonical` module); any other goes through the full decoder.
    pub fn decode(line: &'a [u8]) -> Result<EnvelopeRef<'a>, DecodeError> {
        match canonical::decode(line) {
            Some(e) => Ok(e),
            None => decode_full(line),
        }
    }

    /// The id and origin of a stored line, for a sender that needs nothing
    /// else: read from the start of the header alone when the line has the
    /// canonical layout (the rest of the record is not checked; its
    /// receiver checks the whole of it), else from [`EnvelopeRef::decode`].
    /// `None` if the line does not decode.
    pub fn id_and_origin(line: &'a [u8]) -> Option<(Cow<'a, str>, Cow<'a, str>)> {
        if let Some((id, _, origin)) = canonical::leading_fields(line) {
            return Some((Cow::Borrowed(id), Cow::Borrowed(origin)));
        }
        let env = EnvelopeRef::decode(line).ok()?;
        Some((env.id, env.origin))
    }
}

/// [`EnvelopeRef::decode`] by the JSON parser, for a line in any layout.
fn decode_full(line: &[u8]) -> Result<EnvelopeRef<'_>, DecodeError> {
    let (w, ts_nanos) = decode_wire::<&RawValue>(line)?;
    let payload = match w.payload {
        Some(p) if has_line_break(p.get()) => Cow::Owned(p.get().replace(['\n', '\r'], " ")),
        Some(p) => Cow::Borrowed(p.get()),
        None => Cow::Borrowed("null"),
    };
    Ok(EnvelopeRef {
        id: w.id,
        ts: w.ts,
        ts_nanos,
        channel: w.channel,
        origin: w.origin,
        payload_type: w.payload_type,
        correlation_id: non_empty(w.correlation_id),
        service_name: non_empty(w.service_name),
        payload,
    })
}

impl Envelope {
    /// Decodes one line (without its `\n`) with the reader rules of
    /// keyop-messenger 1.4: unknown keys are ignored, `v` must be the integer 1,
    /// `ts` must parse as RFC 3339, missing strings are empty, a missing
    /// payload is `null`. Line breaks between the payload's JSON tokens become
    /// spaces, so [`Envelope::encode`] always makes one line.
    pub fn decode(line: &[u8]) -> Result<Envelope, DecodeError> {
        let (w, ts_nanos) = decode_wire::<Box<RawValue>>(line)?;
        let payload = match w.payload {
            Some(p) if has_line_break(p.get()) => {
                RawValue::from_string(p.get().replace(['\n', '\r'], " "))
                    .expect("whitespace replaced by whitespace is still JSON")
            }
            Some(p) => p,
            None => RawValue::from_string("null".into()).expect("null is JSON"),
        };
        Ok(Envelope {
            id: w.id.into_owned(),
            ts: w.ts.into_owned(),
            ts_nanos,
            channel: w.channel.into_owned(),
            origin: w.origin.into_owned(),
            payload_type: w.payload_type.into_owned(),
            correlation_id: non_empty(w.correlation_id).map(Cow::into_owned),
            service_name: non_empty(w.service_name).map(Cow::into_owned),
            payload,
        })
    }

    /// The header fields, as [`encode_record`] takes them.
    pub fn header(&self) -> Header<'_> {
        header_of!(self)
    }

    /// This envelope as one record line (with `\n`), keys in the original's order.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(160 + self.payload.get().len());
        encode_record(&mut out, &self.header(), self.payload.get().as_bytes());
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, UNIX_EPOCH};

    /// A record that does not decode but starts as every writer starts one
    /// is refused with its id and channel, so the refusal names it.
    #[test]
    fn unreadable_records_are_named_by_their_leading_fields() {
        let id = "0197a3c5-5e21-7b4f-8c2d-4a1b2c3d4e5f";
        let start = format!(
            r#"{{"v":1,"id":"{id}","ts":"2026-03-31T14:22:01Z","channel":"temps","origin":"n","payload_type":"t","payload":"#
        );
        for rest in ["{\"x\":}}", "1", "[}"] {
            let line = format!("{start}{rest}");
            let e = decode_valid(line.as_bytes(), 1 << 20, NameKind::Channel)
                .expect_err("does not decode");
            assert!(matches!(e.error, RecordError::Unreadable(_)), "{line}");
            assert_eq!((e.id.as_str(), e.channel.as_str()), (id, "temps"), "{line}");
        }
        // Ids and channels that are not valid are still left out.
        let bad_channel = start.replace("temps", "a/b") + "{";
        let e = decode_valid(bad_channel.as_bytes(), 1 << 20, NameKind::Channel)
            .expect_err("does not decode");
        assert_eq!((e.id.as_str(), e.channel.as_str()), (id, ""));
        let e = decode_valid(b"{not json", 1 << 20, NameKind::Channel).expect_err("garbage");
        assert_eq!((e.id.as_str(), e.channel.as_str()), ("", ""));
    }

    #[test]
    fn names() {
        for ok in ["a", "orders", "A.b_c-9", "x.dead-letter"] {
            validate_name(NameKind::Channel, ok).unwrap();
        }
        for bad in [
            "",
            ".",
            "..",
            "a/b",
            "../x",
            "a\0b",
            "a b",
            "é",
            &"x".repeat(256),
        ] {
            assert!(validate_name(NameKind::Channel, bad).is_err(), "{bad:?}");
        }
        validate_name(NameKind::Channel, &"x".repeat(255)).unwrap();
        validate_name(NameKind::PublishChannel, &"x".repeat(243)).unwrap();
        assert!(validate_name(NameKind::PublishChannel, &"x".repeat(244)).is_err());
        validate_name(NameKind::SubscriberId, &"x".repeat(244)).unwrap();
        assert!(validate_name(NameKind::SubscriberId, &"x".repeat(245)).is_err());
        assert!(validate_name(NameKind::PublishChannel, "x.dead-letter").is_err());
        assert!(validate_name(NameKind::SubscriberId, "fed-hub").is_err());
        validate_name(NameKind::Channel, "fed-hub").unwrap();
        let e = validate_name(NameKind::SubscriberId, "a/b").unwrap_err();
        assert!(e.to_string().contains("subscriber id"), "{e}");
        // A peer name is a certificate CN, which may be `host:port`; only
        // peer names take ':'.
        validate_name(NameKind::PeerName, "sensor-1:7741").unwrap();
        validate_name(NameKind::PeerName, "10.0.0.5:7740").unwrap();
        assert!(validate_name(NameKind::Channel, "a:b").is_err());
        assert!(validate_name(NameKind::SubscriberId, "a:b").is_err());
        let e = validate_name(NameKind::PeerName, "a/b:1").unwrap_err();
        assert!(e.to_string().contains("':'"), "{e}");
    }

    #[test]
    fn timestamps_trim_trailing_zeros() {
        let t = |s: u64, n: u32| format_ts(UNIX_EPOCH + Duration::new(s, n));
        assert_eq!(t(1_774_966_921, 0), "2026-03-31T14:22:01Z");
        assert_eq!(t(1_774_966_921, 500_000_000), "2026-03-31T14:22:01.5Z");
        assert_eq!(
            t(1_774_966_921, 123_456_789),
            "2026-03-31T14:22:01.123456789Z"
        );
        assert_eq!(t(1_774_966_921, 1_000), "2026-03-31T14:22:01.000001Z");
        assert_eq!(
            parse_ts_nanos("2026-03-31T14:22:01.5Z"),
            Some(1_774_966_921_500_000_000)
        );
        assert_eq!(
            parse_ts_nanos("2026-03-31T16:22:01+02:00"),
            Some(1_774_966_921_000_000_000)
        );
        assert_eq!(parse_ts_nanos("yesterday"), None);
    }

    #[test]
    fn calendar_matches_chrono_over_the_whole_range() {
        // Every 7919th day (and a varying second) from 1970 to 9999, plus
        // the leap-year edges.
        let mut days: Vec<u64> = (0..2_932_897).step_by(7919).collect();
        days.extend([59, 60, 365, 789, 10_956, 11_016, 11_017, 2_932_896]);
        for (i, d) in days.into_iter().enumerate() {
            let secs = d * 86_400 + (i as u64 * 7_177) % 86_400;
            let want = chrono::DateTime::from_timestamp(secs as i64, 0)
                .unwrap()
                .format("%Y-%m-%dT%H:%M:%SZ")
                .to_string();
            assert_eq!(TsBuf::new(secs, 0).as_str(), want, "day {d}");
        }
        assert_eq!(
            format_ts(UNIX_EPOCH - Duration::from_secs(5)),
            "1970-01-01T00:00:00Z"
        );
    }

    #[test]
    fn fast_timestamp_parser_agrees_with_chrono() {
        let chrono_nanos = |ts: &str| {
            DateTime::parse_from_rfc3339(ts)
                .ok()
                .and_then(|d| d.timestamp_nanos_opt())
        };
        for ts in [
            "1970-01-01T00:00:00Z",
            "2026-03-31T14:22:01.5Z",
            "2026-03-31T14:22:01.123456789Z",
            "2024-02-29T23:59:59.000000001Z",
            "2000-02-29T00:00:00Z",
            "2262-04-11T23:47:16.854775807Z",
        ] {
            assert_eq!(parse_utc_ts(ts.as_bytes()), chrono_nanos(ts), "{ts}");
            assert!(parse_utc_ts(ts.as_bytes()).is_some(), "{ts}");
        }
        // Not the canonical form: left to chrono, which decides.
        for ts in [
            "2023-02-29T00:00:00Z",
            "1900-02-29T00:00:00Z",
            "2026-13-01T00:00:00Z",
            "2026-03-31T24:00:00Z",
            "2026-03-31T14:22:01.Z",
            "2026-03-31T14:22:01.1234567890Z",
            "2026-03-31T14:22:01+02:00",
            "2026-03-31t14:22:01z",
            "1969-12-31T23:59:59Z",
            "2262-04-11T23:47:16.854775808Z",
            "2026-03-31T14:22:60Z",
            "+026-03-31T14:22:01Z",
        ] {
            assert_eq!(parse_utc_ts(ts.as_bytes()), None, "{ts}");
            let _ = parse_ts_nanos(ts);
        }
        assert_eq!(parse_ts_nanos("1969-12-31T23:59:59Z"), Some(-1_000_000_000));
        assert_eq!(parse_ts_nanos("2023-02-29T00:00:00Z"), None);
    }

    #[test]
    fn stamps_share_one_clock_reading() {
        let s = Stamp::now();
        let ts = parse_ts_nanos(s.ts()).unwrap();
        let id = uuid::Uuid::parse_str(s.id()).unwrap();
        let (secs, nanos) = id.get_timestamp().unwrap().to_unix();
        let id_ms = (secs * 1000 + u64::from(nanos) / 1_000_000) as i64;
        // The id keeps milliseconds; the clock sequence may only move it forward.
        assert!(id_ms >= ts / 1_000_000, "{} vs {}", s.id(), s.ts());
        assert!(id_ms - ts / 1_000_000 < 1000, "{} vs {}", s.id(), s.ts());
    }

    #[test]
    fn json_strings_escape_like_serde_json() {
        for s in [
            "",
            "plain",
            "quote\"inside",
            "back\\slash",
            "line\nfeed\ttab\r\u{1}\u{1f}",
            "del\u{7f}",
            "é ✓ 😀",
            "\u{2028}\u{2029}",
            "0123456789abcdef\"",
            "01234567\\89abcdef",
            "0123456789abcde\u{1f}",
            "\u{0}1234567",
            "all clean, sixteen+ bytes ~!@#$%^&*()",
        ] {
            let mut ours = Vec::new();
            push_json_str(&mut ours, s);
            assert_eq!(ours, serde_json::to_vec(s).unwrap(), "{s:?}");
        }
    }

    #[test]
    fn ids_are_uuid_v7_and_increase() {
        let a = new_id();
        let b = new_id();
        assert_eq!(a.len(), 36);
        assert_eq!(&a[14..15], "7");
        assert!(a < b);
    }

    #[test]
    fn record_round_trip_and_key_order() {
        let mut out = Vec::new();
        let h = Header {
            id: "01970a3c-5e21-7b4f-8c2d-4a1b2c3d4e5f",
            ts: "2026-03-31T14:22:01.1234567Z",
            channel: "alerts",
            origin: "sensor-1",
            payload_type: "com.example.Alert",
            correlation_id: Some("c1"),
            service_name: Some("thermostat"),
        };
        encode_record(&mut out, &h, br#"{"message":"hot\nline"}"#);
        let line = String::from_utf8(out.clone()).unwrap();
        assert_eq!(
            line,
            "{\"v\":1,\"id\":\"01970a3c-5e21-7b4f-8c2d-4a1b2c3d4e5f\",\"ts\":\"2026-03-31T14:22:01.1234567Z\",\"channel\":\"alerts\",\"origin\":\"sensor-1\",\"payload_type\":\"com.example.Alert\",\"correlation_id\":\"c1\",\"service_name\":\"thermostat\",\"payload\":{\"message\":\"hot\\nline\"}}\n"
        );
        let env = Envelope::decode(&out[..out.len() - 1]).unwrap();
        assert_eq!(env.encode(), out);
        // Empty optional fields are omitted.
        let mut plain = Vec::new();
        encode_record(
            &mut plain,
            &Header {
                correlation_id: Some(""),
                service_name: None,
                ..h
            },
            b"null",
        );
        let s = String::from_utf8(plain).unwrap();
        assert!(!s.contains("correlation_id") && !s.contains("service_name"));
    }

    #[test]
    fn decode_follows_reader_rules() {
        assert!(Envelope::decode(b"not json").is_err());
        assert!(Envelope::decode(br#"{"v":2,"ts":"2026-03-31T14:22:01Z"}"#).is_err());
        assert!(Envelope::decode(br#"{"v":1.0,"ts":"2026-03-31T14:22:01Z"}"#).is_err());
        assert!(Envelope::decode(br#"{"ts":"2026-03-31T14:22:01Z"}"#).is_err());
        assert!(Envelope::decode(br#"{"v":1,"ts":"2026-13-31T14:22:01Z"}"#).is_err());
        // The array form serde would accept for a struct is not an envelope.
        assert!(
            Envelope::decode(br#"[1,"id","2026-03-31T14:22:01Z","ch","o","t",null,null,{}]"#)
                .is_err()
        );
        assert!(Envelope::decode(br#"  {"v":1,"ts":"2026-03-31T14:22:01Z"}"#).is_ok());
        let e = Envelope::decode(br#"{"v":1,"ts":"2026-03-31T14:22:01Z","future":[1],"id":"x"}"#)
            .unwrap();
        assert_eq!(e.id, "x");
        assert_eq!(e.payload.get(), "null");
        assert_eq!(e.payload_type, "");
    }
}
