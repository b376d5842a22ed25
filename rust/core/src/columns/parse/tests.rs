//! Unit tests of the payload parser.

use super::*;

fn parse(lines: &str, fields: &[(&str, FieldKind)]) -> Option<Vec<FieldColumn>> {
    parse_payload_fields(lines.as_bytes(), lines.lines().count(), fields)
}

fn ints(c: &FieldColumn) -> Vec<i64> {
    c.data
        .chunks(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

#[test]
fn fields_parse_into_arrow_buffers_with_nulls() {
    let lines = concat!(
        r#"{"s":"a\"b","n":-5,"f":1.5,"b":true,"t":"2026-03-31T00:00:01.5Z","x":[1,{"y":2}]}"#,
        "\n",
        r#"{"s":null,"f":2,"b":false,"t":null}"#,
        "\n",
        r#"{"n":1,"n":2,"s":"\ud83d\ude00"}"#,
        "\n",
    );
    let kinds = [
        ("s", FieldKind::Text),
        ("n", FieldKind::Int(8)),
        ("f", FieldKind::Float(8)),
        ("b", FieldKind::Bool),
        ("t", FieldKind::TimestampMicros),
    ];
    let cols = parse(lines, &kinds).unwrap();
    let [s, n, f, b, t] = &cols[..] else { panic!() };
    assert_eq!(s.offsets, [0, 3, 3, 7]);
    assert_eq!(s.data, "a\"b😀".as_bytes());
    assert_eq!((s.validity[0], s.nulls), (0b101, 1));
    // A repeated key's last value counts, as in Python's json.loads.
    assert_eq!(
        (ints(n), n.validity[0], n.nulls),
        (vec![-5, 0, 2], 0b101, 1)
    );
    let floats: Vec<f64> = f
        .data
        .chunks(8)
        .map(|b| f64::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!((floats, f.validity[0]), (vec![1.5, 2.0, 0.0], 0b011));
    assert_eq!((b.data[0], b.validity[0], b.nulls), (0b001, 0b011, 1));
    assert_eq!(ints(t), [1_774_915_201_500_000, 0, 0]);
    assert_eq!((t.validity[0], t.nulls), (0b001, 2));
}

#[test]
fn a_value_that_is_not_plain_refuses_the_batch() {
    let ok = "{\"v\":1}\n";
    for (value, kind) in [
        ("\"1\"", FieldKind::Int(8)),
        ("1.0", FieldKind::Int(8)),
        ("1e2", FieldKind::Int(8)),
        ("true", FieldKind::Int(8)),
        ("128", FieldKind::Int(1)),
        ("-129", FieldKind::Int(1)),
        ("2147483648", FieldKind::Int(4)),
        ("9223372036854775808", FieldKind::Int(8)),
        ("\"1.5\"", FieldKind::Float(8)),
        ("1e400", FieldKind::Float(8)),
        ("1e39", FieldKind::Float(4)),
        ("1", FieldKind::Bool),
        ("5", FieldKind::Text),
        ("{}", FieldKind::Text),
        ("\"\\ud800\"", FieldKind::Text),
        ("1774915200", FieldKind::TimestampMicros),
        ("\"2026-02-29T00:00:00Z\"", FieldKind::TimestampMicros),
        ("\"2026-03-31\\u0054\"", FieldKind::TimestampMicros),
    ] {
        let lines = format!("{ok}{{\"v\":{value}}}\n");
        assert!(
            parse(&lines, &[("v", kind)]).is_none(),
            "{value} as {kind:?}"
        );
    }
    // In range: the bounds themselves.
    let lines = "{\"v\":127}\n{\"v\":-128}\n";
    assert_eq!(
        parse(lines, &[("v", FieldKind::Int(1))]).unwrap()[0].data,
        [127, 128]
    );
    // A payload that is not an object, or fewer payloads than rows.
    assert!(parse("[1]\n", &[("v", FieldKind::Int(8))]).is_none());
    assert!(parse_payload_fields(ok.as_bytes(), 2, &[("v", FieldKind::Int(8))]).is_none());
    assert!(parse_payload_fields(ok.as_bytes(), 0, &[("v", FieldKind::Int(8))]).is_none());
    assert!(parse(ok, &[]).is_none());
    // More rows than the data can hold: refused before any buffer is sized.
    assert!(parse_payload_fields(b"{}", 1 << 60, &[("v", FieldKind::Int(8))]).is_none());
    assert!(parse_payload_fields(b"{}{}", 2, &[("v", FieldKind::Int(8))]).is_some());
}

#[test]
fn other_values_are_skipped_by_their_structure() {
    let lines = concat!(
        r#"{"x":{"a":"}]","b":[1,{"c":"\"}"}]},"y":[],"z":{}, "\u0073" : "k" ,"n":-1.5e3}"#,
        "\n",
        r#" { } "#,
        "\n",
        r#"{"s":"a\\","x\"":"\"s\":1"}"#,
        "\n",
    );
    let cols = parse(lines, &[("s", FieldKind::Text), ("n", FieldKind::Float(8))]).unwrap();
    assert_eq!(
        (cols[0].offsets.as_slice(), cols[0].data.as_slice()),
        (&[0, 1, 1, 3][..], &b"ka\\"[..])
    );
    assert_eq!(cols[1].data[..8], (-1500f64).to_le_bytes());
    assert_eq!((cols[0].nulls, cols[1].nulls), (1, 2));
}

#[test]
fn data_that_is_not_json_never_panics() {
    let fields = [("s", FieldKind::Text), ("n", FieldKind::Int(8))];
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let alphabet = b"{}[]\":,\\ \n0-9.eEtrufalsn\xc3\xa9";
    for len in 0..2_000 {
        let bytes: Vec<u8> = (0..len % 40)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                alphabet[(x % alphabet.len() as u64) as usize]
            })
            .collect();
        for rows in 0..3 {
            if let Some(cols) = parse_payload_fields(&bytes, rows, &fields) {
                // What it took for JSON, serde_json takes too.
                let text = std::str::from_utf8(&bytes).unwrap();
                let values: Vec<serde_json::Value> = serde_json::Deserializer::from_str(text)
                    .into_iter()
                    .collect::<Result<_, _>>()
                    .unwrap_or_default();
                if values.len() == rows {
                    assert!(values.iter().all(serde_json::Value::is_object));
                }
                assert_eq!(cols[0].offsets.len(), rows + 1);
            }
        }
    }
    for bad in [
        "{\"s\":\"a\n",
        "{\"s\"",
        "{\"s\":",
        "{\"s\":1,}",
        "{,}",
        "{\"s\" 1}",
    ] {
        assert!(
            parse_payload_fields(bad.as_bytes(), 1, &fields).is_none(),
            "{bad}"
        );
    }
}

#[test]
fn numbers_follow_the_json_grammar() {
    for (text, want) in [
        ("0", Some(true)),
        ("-0", Some(true)),
        ("120", Some(true)),
        ("1.5", Some(false)),
        ("-0.5e-3", Some(false)),
        ("1E+2", Some(false)),
        ("01", None),
        ("1.", None),
        (".5", None),
        ("1e", None),
        ("+1", None),
        ("-", None),
        ("inf", None),
        ("NaN", None),
        ("1 ", None),
    ] {
        assert_eq!(json_number(text.as_bytes()), want, "{text}");
    }
}

#[test]
fn timestamps_read_as_the_python_conversion_reads_them() {
    let at = |s: &str| parse_timestamp(s.as_bytes());
    let base = 1_774_915_200_000_000; // 2026-03-31T00:00:00Z
    assert_eq!(at("2026-03-31"), Some(base));
    assert_eq!(at("2026-03-31Z"), Some(base));
    assert_eq!(at("2026-03-31t01:02"), Some(base + 3_720_000_000));
    assert_eq!(at("2026-03-31 01:02:03"), Some(base + 3_723_000_000));
    assert_eq!(at("2026-03-31T00:00:00.1234567Z"), Some(base + 123_456));
    assert_eq!(at("2026-03-31T00:00:00.000001z"), Some(base + 1));
    assert_eq!(at("2026-03-31T02:00:00+02"), Some(base));
    assert_eq!(at("2026-03-31T02:30:00+0230"), Some(base));
    assert_eq!(at("2026-03-30T22:00:00-02:00"), Some(base));
    assert_eq!(at("1969-12-31T23:59:59.999999Z"), Some(-1));
    assert_eq!(at("0001-01-01T00:00:00Z"), Some(-62_135_596_800_000_000));
    assert_eq!(at("2024-02-29T00:00:00Z"), Some(1_709_164_800_000_000));
    for bad in [
        "2026-03-31T24:00:00Z",
        "2026-03-31T23:60:00Z",
        "2026-03-31T23:59:60Z",
        "2026-13-01",
        "2026-00-01",
        "2026-04-31",
        "2100-02-29",
        "0000-01-01",
        "0001-01-01T00:00:00+01:00",
        "9999-12-31T23:00:00-01:00",
        "2026-03-31T00:00:00+24:00",
        "2026-03-31T00:00:00.Z",
        "2026-03-31T00:00:00 Z",
        " 2026-03-31",
        "2026-03-31T1:00",
        "2026-3-31",
        "2026-03-31T00:00:00+2",
        "2026/03/31",
        "",
    ] {
        assert_eq!(at(bad), None, "{bad}");
    }
}

#[test]
fn timestamps_written_by_the_encoder_read_back() {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for _ in 0..10_000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        // Years 1..=9999.
        let micros = (x % 315_537_897_600_000_000) as i64 - 62_135_596_800_000_000;
        let mut text = Vec::new();
        super::super::write_timestamp(&mut text, micros, x & 1 == 0).unwrap();
        assert_eq!(
            parse_timestamp(&text),
            Some(micros),
            "{}",
            String::from_utf8_lossy(&text)
        );
    }
}
