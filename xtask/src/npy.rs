//! A minimal reader and writer of NumPy `.npy` files: versions 1.0, 2.0 and 3.0, little-endian,
//! C order, element types `<f8`, `<f4`, `<i8` and `<i4`. Anything else is rejected with an error
//! that names the file and says what it holds.

use kda_core::{fmt_shape, KdaError};
use std::path::Path;

const MAGIC: &[u8; 6] = b"\x93NUMPY";

/// The elements of an array, in C order.
#[derive(Debug, Clone, PartialEq)]
pub enum NpyData {
    /// `<f8` (float64).
    F64(Vec<f64>),
    /// `<f4` (float32).
    F32(Vec<f32>),
    /// `<i8` (int64).
    I64(Vec<i64>),
    /// `<i4` (int32).
    I32(Vec<i32>),
}

impl NpyData {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            NpyData::F64(v) => v.len(),
            NpyData::F32(v) => v.len(),
            NpyData::I64(v) => v.len(),
            NpyData::I32(v) => v.len(),
        }
    }
    /// The NumPy name of the element type (`float64`, ...).
    pub fn dtype_name(&self) -> &'static str {
        match self {
            NpyData::F64(_) => "float64",
            NpyData::F32(_) => "float32",
            NpyData::I64(_) => "int64",
            NpyData::I32(_) => "int32",
        }
    }
    fn descr(&self) -> &'static str {
        match self {
            NpyData::F64(_) => "<f8",
            NpyData::F32(_) => "<f4",
            NpyData::I64(_) => "<i8",
            NpyData::I32(_) => "<i4",
        }
    }
    /// Floating-point elements widened to f64; `None` for integer arrays.
    pub fn floats(&self) -> Option<Vec<f64>> {
        match self {
            NpyData::F64(v) => Some(v.clone()),
            NpyData::F32(v) => Some(v.iter().map(|&x| f64::from(x)).collect()),
            NpyData::I64(_) | NpyData::I32(_) => None,
        }
    }
    /// Integer elements widened to i64; `None` for floating-point arrays.
    pub fn ints(&self) -> Option<Vec<i64>> {
        match self {
            NpyData::I64(v) => Some(v.clone()),
            NpyData::I32(v) => Some(v.iter().map(|&x| i64::from(x)).collect()),
            NpyData::F64(_) | NpyData::F32(_) => None,
        }
    }
}

/// An array: its shape (empty for a 0-d scalar) and its elements.
#[derive(Debug, Clone, PartialEq)]
pub struct NpyArray {
    /// The extents, outermost first.
    pub shape: Vec<usize>,
    /// The elements in C order.
    pub data: NpyData,
}

impl NpyArray {
    /// An array; fails when the element count does not match the shape.
    pub fn new(shape: &[usize], data: NpyData) -> Result<Self, KdaError> {
        let want: usize = shape.iter().product();
        if want != data.len() {
            return Err(KdaError::shape(
                "npy array",
                format!("{want} elements for shape {}", fmt_shape(shape)),
                format!("{} elements", data.len()),
            ));
        }
        Ok(Self { shape: shape.to_vec(), data })
    }
}

/// The three keys of an NPY header.
struct Header {
    descr: String,
    fortran_order: bool,
    shape: Vec<usize>,
}

/// A value of the header dict that this reader understands.
enum Value {
    Str(String),
    Bool(bool),
    Tuple(Vec<usize>),
}

/// A cursor over the header text, a Python dict literal.
struct Cursor<'a> {
    s: &'a [u8],
    pos: usize,
}

impl Cursor<'_> {
    fn peek(&mut self) -> Option<u8> {
        while self.s.get(self.pos).is_some_and(|c| c.is_ascii_whitespace()) {
            self.pos += 1;
        }
        self.s.get(self.pos).copied()
    }
    fn eat(&mut self, c: u8) -> bool {
        let hit = self.peek() == Some(c);
        self.pos += usize::from(hit);
        hit
    }
    fn expect(&mut self, c: u8) -> Result<(), String> {
        if self.eat(c) {
            return Ok(());
        }
        Err(format!("expected `{}` at byte {}", c as char, self.pos))
    }
    fn string(&mut self) -> Result<String, String> {
        let quote = self.peek().filter(|&c| c == b'\'' || c == b'"').ok_or("expected a quoted string")?;
        let start = self.pos + 1;
        let len = self.s[start..].iter().position(|&c| c == quote).ok_or("unterminated string")?;
        self.pos = start + len + 1;
        Ok(String::from_utf8_lossy(&self.s[start..start + len]).into_owned())
    }
    fn int(&mut self) -> Result<usize, String> {
        self.peek();
        let start = self.pos;
        while self.s.get(self.pos).is_some_and(u8::is_ascii_digit) {
            self.pos += 1;
        }
        let text = std::str::from_utf8(&self.s[start..self.pos]).map_err(|e| e.to_string())?;
        let n = text.parse().map_err(|_| format!("expected a non-negative integer at byte {start}"))?;
        self.eat(b'L'); // Python 2 long suffix.
        Ok(n)
    }
    fn value(&mut self) -> Result<Value, String> {
        match self.peek() {
            Some(b'\'' | b'"') => self.string().map(Value::Str),
            Some(b'(') => {
                self.pos += 1;
                let mut dims = Vec::new();
                while !self.eat(b')') {
                    dims.push(self.int()?);
                    if !self.eat(b',') {
                        self.expect(b')')?;
                        break;
                    }
                }
                Ok(Value::Tuple(dims))
            }
            Some(b'[') => Err("a structured dtype (not supported)".into()),
            _ => {
                for (word, b) in [("True", true), ("False", false)] {
                    if self.s[self.pos..].starts_with(word.as_bytes()) {
                        self.pos += word.len();
                        return Ok(Value::Bool(b));
                    }
                }
                Err(format!("unexpected value at byte {}", self.pos))
            }
        }
    }
}

fn parse_header(text: &[u8]) -> Result<Header, String> {
    let mut c = Cursor { s: text, pos: 0 };
    let (mut descr, mut fortran_order, mut shape) = (None, None, None);
    c.expect(b'{')?;
    while !c.eat(b'}') {
        let key = c.string()?;
        c.expect(b':')?;
        match (key.as_str(), c.value()?) {
            ("descr", Value::Str(s)) => descr = Some(s),
            ("fortran_order", Value::Bool(b)) => fortran_order = Some(b),
            ("shape", Value::Tuple(t)) => shape = Some(t),
            (k @ ("descr" | "fortran_order" | "shape"), _) => return Err(format!("a bad value for `{k}`")),
            _ => {}
        }
        if !c.eat(b',') {
            c.expect(b'}')?;
            break;
        }
    }
    Ok(Header {
        descr: descr.ok_or("no `descr` key")?,
        fortran_order: fortran_order.ok_or("no `fortran_order` key")?,
        shape: shape.ok_or("no `shape` key")?,
    })
}

fn decode<T, const N: usize>(bytes: &[u8], f: fn([u8; N]) -> T) -> Vec<T> {
    bytes.chunks_exact(N).map(|c| f(c.try_into().unwrap_or([0; N]))).collect()
}

/// Parses the bytes of an `.npy` file; errors name `name` (usually the path).
pub fn parse(bytes: &[u8], name: &str) -> Result<NpyArray, KdaError> {
    let io = |expected: &str, got: String| KdaError::io(name, expected, got);
    if bytes.len() < 10 || &bytes[..6] != MAGIC {
        return Err(io("an .npy file starting with \\x93NUMPY", "no NPY magic string".into()));
    }
    let (major, minor) = (bytes[6], bytes[7]);
    let (header_start, header_len) = match major {
        1 => (10, usize::from(u16::from_le_bytes([bytes[8], bytes[9]]))),
        2 | 3 if bytes.len() >= 12 => {
            (12, u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize)
        }
        2 | 3 => return Err(io("a complete header", format!("{} bytes", bytes.len()))),
        _ => return Err(io("NPY format version 1.0, 2.0 or 3.0", format!("version {major}.{minor}"))),
    };
    let data_start = header_start + header_len;
    let header = bytes
        .get(header_start..data_start)
        .ok_or_else(|| io("a complete header", format!("a file of {} bytes", bytes.len())))?;
    let h = parse_header(header).map_err(|e| {
        io("a header dict with descr, fortran_order and shape", format!("{e} in {:?}", header.escape_ascii()))
    })?;
    if h.fortran_order {
        return Err(io(
            "C order (fortran_order: False)",
            "a Fortran-order array; save np.ascontiguousarray(x)".into(),
        ));
    }
    let size = match h.descr.as_str() {
        "<f8" | "<i8" => 8,
        "<f4" | "<i4" => 4,
        d => {
            return Err(KdaError::dtype(
                name,
                "little-endian float64, float32, int64 or int32 ('<f8', '<f4', '<i8', '<i4')",
                format!("descr '{d}'"),
            ))
        }
    };
    let count = h.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
    let want = count.and_then(|c| c.checked_mul(size));
    let (Some(count), Some(want)) = (count, want) else {
        return Err(io("a shape whose size fits in memory", format!("shape {:?}", h.shape)));
    };
    let body = &bytes[data_start..];
    if body.len() != want {
        let what = if body.len() < want { "truncated data" } else { "trailing bytes" };
        return Err(io(
            &format!("{want} data bytes for {} x {} of shape {}", count, h.descr, fmt_shape(&h.shape)),
            format!("{} bytes ({what})", body.len()),
        ));
    }
    let data = match h.descr.as_str() {
        "<f8" => NpyData::F64(decode(body, f64::from_le_bytes)),
        "<f4" => NpyData::F32(decode(body, f32::from_le_bytes)),
        "<i8" => NpyData::I64(decode(body, i64::from_le_bytes)),
        _ => NpyData::I32(decode(body, i32::from_le_bytes)),
    };
    Ok(NpyArray { shape: h.shape, data })
}

/// Encodes an array as an `.npy` file (version 1.0; 2.0 only for headers over 64 KiB), with the
/// header padded so the data starts on a 64-byte boundary.
pub fn encode(arr: &NpyArray) -> Vec<u8> {
    let dims: Vec<String> = arr.shape.iter().map(|d| d.to_string()).collect();
    let shape = match dims.len() {
        1 => format!("({},)", dims[0]),
        _ => format!("({})", dims.join(", ")),
    };
    let dict = format!("{{'descr': '{}', 'fortran_order': False, 'shape': {shape}, }}", arr.data.descr());
    let (version, prefix) = if dict.len() + 11 + 64 <= usize::from(u16::MAX) { (1u8, 10) } else { (2, 12) };
    let pad = (64 - (prefix + dict.len() + 1) % 64) % 64;
    let header = format!("{dict}{}\n", " ".repeat(pad));
    let mut out = Vec::with_capacity(prefix + header.len() + arr.data.len() * 8);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&[version, 0]);
    if version == 1 {
        out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    } else {
        out.extend_from_slice(&(header.len() as u32).to_le_bytes());
    }
    out.extend_from_slice(header.as_bytes());
    match &arr.data {
        NpyData::F64(v) => v.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        NpyData::F32(v) => v.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        NpyData::I64(v) => v.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        NpyData::I32(v) => v.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
    }
    out
}

/// Reads an `.npy` file; every error names the path.
pub fn read(path: &Path) -> Result<NpyArray, KdaError> {
    let name = path.display().to_string();
    let bytes =
        std::fs::read(path).map_err(|e| KdaError::io(&name, "a readable .npy file", e.to_string()))?;
    parse(&bytes, &name)
}

/// Writes an `.npy` file; the error names the path.
pub fn write(path: &Path, arr: &NpyArray) -> Result<(), KdaError> {
    std::fs::write(path, encode(arr))
        .map_err(|e| KdaError::io(path.display().to_string(), "a writable file", e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kda_core::ErrorKind;
    use rstest::rstest;

    fn header_bytes(version: u8, dict: &str) -> Vec<u8> {
        let mut out = MAGIC.to_vec();
        out.extend_from_slice(&[version, 0]);
        if version == 1 {
            out.extend_from_slice(&(dict.len() as u16).to_le_bytes());
        } else {
            out.extend_from_slice(&(dict.len() as u32).to_le_bytes());
        }
        out.extend_from_slice(dict.as_bytes());
        out
    }

    #[rstest]
    #[case::f64_2d(vec![2, 3], NpyData::F64(vec![1.5, -2.0, 0.0, 1e-300, f64::MAX, -0.0]))]
    #[case::f32_3d(vec![1, 2, 2], NpyData::F32(vec![1.5, -2.0, 3.25, f32::MIN_POSITIVE]))]
    #[case::i64_1d(vec![4], NpyData::I64(vec![0, 3, -7, i64::MAX]))]
    #[case::i32_1d(vec![3], NpyData::I32(vec![0, 5, i32::MIN]))]
    #[case::scalar_0d(vec![], NpyData::F64(vec![42.0]))]
    #[case::empty(vec![0, 3], NpyData::F32(vec![]))]
    fn round_trip(#[case] shape: Vec<usize>, #[case] data: NpyData) {
        let arr = NpyArray::new(&shape, data).expect("valid array");
        let bytes = encode(&arr);
        let header_len = usize::from(u16::from_le_bytes([bytes[8], bytes[9]]));
        assert_eq!((10 + header_len) % 64, 0, "data must start 64-byte aligned");
        assert_eq!(bytes[9 + header_len], b'\n');
        assert_eq!(parse(&bytes, "x.npy").expect("parses"), arr);
    }

    #[test]
    fn shape_tuples_are_written_like_numpy() {
        let text = |shape: &[usize]| {
            let n = shape.iter().product();
            String::from_utf8_lossy(&encode(&NpyArray::new(shape, NpyData::I32(vec![0; n])).expect("ok")))
                .into_owned()
        };
        assert!(text(&[]).contains("'shape': (), }"));
        assert!(text(&[3]).contains("'shape': (3,), }"));
        assert!(text(&[2, 3]).contains("'descr': '<i4', 'fortran_order': False, 'shape': (2, 3), }"));
    }

    #[rstest]
    #[case::v2(2)]
    #[case::v3(3)]
    fn reads_versions_2_and_3(#[case] version: u8) {
        let mut bytes = header_bytes(version, "{\"descr\":'<f4',\"shape\":(2L,),'fortran_order':False}\n");
        bytes.extend_from_slice(&1.0f32.to_le_bytes());
        bytes.extend_from_slice(&(-3.0f32).to_le_bytes());
        let arr = parse(&bytes, "v.npy").expect("parses");
        assert_eq!(arr, NpyArray { shape: vec![2], data: NpyData::F32(vec![1.0, -3.0]) });
    }

    #[rstest]
    #[case::bad_magic(b"\x93NUMPZ\x01\x00\x00\x00".to_vec(), ErrorKind::Io, "magic")]
    #[case::too_short(b"\x93NUM".to_vec(), ErrorKind::Io, "magic")]
    #[case::version_4(header_bytes(4, "{}"), ErrorKind::Io, "version 4.0")]
    #[case::fortran(
        header_bytes(1, "{'descr': '<f8', 'fortran_order': True, 'shape': (), }"),
        ErrorKind::Io,
        "Fortran"
    )]
    #[case::big_endian(
        header_bytes(1, "{'descr': '>f8', 'fortran_order': False, 'shape': (), }"),
        ErrorKind::DType,
        "'>f8'"
    )]
    #[case::uint8(
        header_bytes(1, "{'descr': '|u1', 'fortran_order': False, 'shape': (), }"),
        ErrorKind::DType,
        "'|u1'"
    )]
    #[case::structured(
        header_bytes(1, "{'descr': [('a', '<f8')], 'fortran_order': False, 'shape': (), }"),
        ErrorKind::Io,
        "structured"
    )]
    #[case::no_shape(
        header_bytes(1, "{'descr': '<f8', 'fortran_order': False}"),
        ErrorKind::Io,
        "no `shape`"
    )]
    #[case::bad_dict(header_bytes(1, "{'descr' '<f8'}"), ErrorKind::Io, "expected `:`")]
    #[case::header_past_end(b"\x93NUMPY\x01\x00\xff\x00{}".to_vec(), ErrorKind::Io, "complete header")]
    #[case::truncated(
        header_bytes(1, "{'descr': '<f8', 'fortran_order': False, 'shape': (2,), }"),
        ErrorKind::Io,
        "truncated"
    )]
    fn rejects(#[case] bytes: Vec<u8>, #[case] kind: ErrorKind, #[case] needle: &str) {
        let err = parse(&bytes, "dir/q.npy").expect_err("must fail");
        assert_eq!(err.kind(), kind, "{err}");
        assert_eq!(err.arg(), "dir/q.npy");
        assert!(err.to_string().contains(needle), "`{err}` lacks `{needle}`");
    }

    #[test]
    fn rejects_trailing_bytes_and_truncation_by_one() {
        let arr = NpyArray::new(&[3], NpyData::F64(vec![1.0, 2.0, 3.0])).expect("ok");
        let mut bytes = encode(&arr);
        bytes.push(0);
        assert!(parse(&bytes, "a").expect_err("trailing").to_string().contains("trailing"));
        bytes.truncate(bytes.len() - 2);
        assert!(parse(&bytes, "a").expect_err("short").to_string().contains("truncated"));
    }

    #[test]
    fn file_round_trip_and_missing_file() {
        let dir = std::env::temp_dir().join(format!("kda-npy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("a.npy");
        let arr = NpyArray::new(&[2], NpyData::I64(vec![0, 9])).expect("ok");
        write(&path, &arr).expect("write");
        assert_eq!(read(&path).expect("read"), arr);
        let err = read(&dir.join("missing.npy")).expect_err("missing");
        assert_eq!(err.kind(), ErrorKind::Io);
        assert!(err.to_string().contains("missing.npy"), "{err}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn array_new_checks_count_and_conversions() {
        assert!(NpyArray::new(&[2, 2], NpyData::F64(vec![1.0])).is_err());
        assert_eq!(NpyData::I32(vec![3]).ints(), Some(vec![3]));
        assert_eq!(NpyData::I32(vec![3]).floats(), None);
        assert_eq!(NpyData::F32(vec![0.5]).floats(), Some(vec![0.5]));
        assert_eq!(NpyData::F64(vec![0.5]).ints(), None);
    }
}
