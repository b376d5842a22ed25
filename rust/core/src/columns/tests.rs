//! Unit tests of the column encoder.

use super::*;

#[test]
fn timestamps_and_dates_are_rfc3339() {
    let mut s = Vec::new();
    write_timestamp(&mut s, 1_774_915_200_000_000 + 1_500_000, true).unwrap();
    assert_eq!(s, b"2026-03-31T00:00:01.5Z");
    s.clear();
    write_timestamp(&mut s, -1, false).unwrap();
    assert_eq!(s, b"1969-12-31T23:59:59.999999");
    s.clear();
    write_timestamp(&mut s, 1_000, true).unwrap();
    assert_eq!(s, b"1970-01-01T00:00:00.001Z");
    s.clear();
    write_date(&mut s, 20_543).unwrap();
    assert_eq!(s, b"2026-03-31");
    assert_eq!(civil_from_days(0), (1970, 1, 1));
    assert_eq!(civil_from_days(-1), (1969, 12, 31));
}

#[test]
fn columns_encode_as_json_objects() {
    let ints: Vec<u8> = [1i64, -2, 3].iter().flat_map(|v| v.to_le_bytes()).collect();
    let floats: Vec<u8> = [1.5f64, f64::NAN, 2.0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let offsets: Vec<u8> = [0i32, 1, 3, 3]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let cols = [
        Column {
            name: "n",
            values: ColumnValues::Int {
                width: 8,
                data: &ints,
            },
            validity: Some(&[0b101]),
            offset: 0,
        },
        Column {
            name: "f\"",
            values: ColumnValues::Float {
                width: 8,
                data: &floats,
            },
            validity: None,
            offset: 0,
        },
        Column {
            name: "s",
            values: ColumnValues::Text {
                offsets: &offsets,
                data: b"a\"b",
            },
            validity: None,
            offset: 0,
        },
        Column {
            name: "b",
            values: ColumnValues::Bool(&[0b010]),
            validity: None,
            offset: 0,
        },
    ];
    let mut out = Vec::new();
    let ends = encode_payloads(&cols, 3, &mut out).unwrap();
    let text = String::from_utf8(out).unwrap();
    assert_eq!(&text[..ends[0]], r#"{"n":1,"f\"":1.5,"s":"a","b":false}"#);
    assert_eq!(
        &text[ends[0]..ends[1]],
        r#"{"n":null,"f\"":"NaN","s":"\"b","b":true}"#
    );
    assert_eq!(&text[ends[1]..], r#"{"n":3,"f\"":2.0,"s":"","b":false}"#);
    let short = Column {
        name: "x",
        values: ColumnValues::Int {
            width: 8,
            data: &ints,
        },
        validity: None,
        offset: 1,
    };
    assert!(encode_payloads(&[short], 3, &mut Vec::new()).is_err());
}

fn le<T: Copy, const N: usize>(values: &[T], to: fn(T) -> [u8; N]) -> Vec<u8> {
    values.iter().flat_map(|&v| to(v)).collect()
}

#[test]
fn text_checked_once_still_refuses_a_split_character() {
    let data = "é€x".as_bytes(); // 2 + 3 + 1 bytes
    let offsets = le(&[0i32, 2, 5, 6], i32::to_le_bytes);
    let text = |offsets: &'static [u8], data: &'static [u8]| Column {
        name: "s",
        values: ColumnValues::Text { offsets, data },
        validity: None,
        offset: 0,
    };
    let offsets: &'static [u8] = offsets.leak();
    let mut out = Vec::new();
    let ends = encode_payloads(&[text(offsets, data)], 3, &mut out).unwrap();
    assert_eq!(&out[..ends[0]], r#"{"s":"é"}"#.as_bytes());
    assert_eq!(&out[ends[1]..], r#"{"s":"x"}"#.as_bytes());
    // An offset inside "€": valid data, but not a value.
    let split: &'static [u8] = le(&[0i32, 3], i32::to_le_bytes).leak();
    let err = encode_payloads(&[text(split, data)], 1, &mut Vec::new()).unwrap_err();
    assert!(err.reason.contains("not UTF-8"), "{err:?}");
    // Data not UTF-8 as a whole: each value is checked on its own.
    let bad: &'static [u8] = b"ab\xff";
    let two: &'static [u8] = le(&[0i32, 1, 2], i32::to_le_bytes).leak();
    let mut out = Vec::new();
    encode_payloads(&[text(two, bad)], 2, &mut out).unwrap();
    assert_eq!(out, br#"{"s":"a"}{"s":"b"}"#);
    let three: &'static [u8] = le(&[0i32, 1, 2, 3], i32::to_le_bytes).leak();
    assert!(encode_payloads(&[text(three, bad)], 3, &mut Vec::new()).is_err());
    // Offsets past the data.
    let past: &'static [u8] = le(&[0i32, 9], i32::to_le_bytes).leak();
    assert!(encode_payloads(&[text(past, data)], 1, &mut Vec::new()).is_err());
}

#[test]
fn dates_of_consecutive_rows_follow_each_day() {
    // Timestamps across midnight and back, and dates of two columns:
    // each value is its own, whatever the row before it was.
    let day = 86_400_000_000i64;
    let ts = le(
        &[day - 1, day, day - 1, 3 * day + 1, 3 * day + 1],
        i64::to_le_bytes,
    );
    let dates = le(&[0i32, 0, 1, -1, 0], i32::to_le_bytes);
    let cols = [
        Column {
            name: "t",
            values: ColumnValues::TimestampMicros {
                data: &ts,
                utc: true,
            },
            validity: None,
            offset: 0,
        },
        Column {
            name: "d",
            values: ColumnValues::Date32(&dates),
            validity: None,
            offset: 0,
        },
    ];
    let mut out = Vec::new();
    encode_payloads(&cols, 5, &mut out).unwrap();
    let text = String::from_utf8(out).unwrap();
    assert_eq!(
        text,
        concat!(
            r#"{"t":"1970-01-01T23:59:59.999999Z","d":"1970-01-01"}"#,
            r#"{"t":"1970-01-02T00:00:00Z","d":"1970-01-01"}"#,
            r#"{"t":"1970-01-01T23:59:59.999999Z","d":"1970-01-02"}"#,
            r#"{"t":"1970-01-04T00:00:00.000001Z","d":"1969-12-31"}"#,
            r#"{"t":"1970-01-04T00:00:00.000001Z","d":"1970-01-01"}"#,
        )
    );
}
