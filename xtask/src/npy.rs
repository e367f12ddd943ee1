//! NumPy `.npy` files for `cargo xtask run`, read and written by `npyz`: versions 1.0, 2.0 and
//! 3.0, little-endian, C order, element types `<f8`, `<f4`, `<i8` and `<i4`. Anything else is
//! rejected with an error that names the file and says what it holds.

use kda_core::{fmt_shape, KdaError};
use std::path::Path;

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

/// Parses the bytes of an `.npy` file (through `npyz`); errors name `name` (usually the path).
pub fn parse(bytes: &[u8], name: &str) -> Result<NpyArray, KdaError> {
    let io = |expected: &str, got: String| KdaError::io(name, expected, got);
    let mut body = bytes;
    let header = npyz::NpyHeader::from_reader(&mut body).map_err(|e| {
        io(
            "an .npy file (format 1.0, 2.0 or 3.0, a header with descr, fortran_order and shape)",
            e.to_string(),
        )
    })?;
    if header.order() == npyz::Order::Fortran {
        return Err(io(
            "C order (fortran_order: False)",
            "a Fortran-order array; save np.ascontiguousarray(x)".into(),
        ));
    }
    let descr = match header.dtype() {
        npyz::DType::Plain(t) => t.to_string(),
        npyz::DType::Record(_) => "a structured dtype".to_string(),
        npyz::DType::Array(..) => "an array dtype".to_string(),
    };
    let size = match descr.as_str() {
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
    let shape = header
        .shape()
        .iter()
        .map(|&d| usize::try_from(d).ok())
        .collect::<Option<Vec<usize>>>()
        .ok_or_else(|| io("a shape whose size fits in memory", format!("shape {:?}", header.shape())))?;
    let count = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
    let want = count.and_then(|c| c.checked_mul(size));
    let (Some(count), Some(want)) = (count, want) else {
        return Err(io("a shape whose size fits in memory", format!("shape {shape:?}")));
    };
    if body.len() != want {
        let what = if body.len() < want { "truncated data" } else { "trailing bytes" };
        return Err(io(
            &format!("{want} data bytes for {count} x {descr} of shape {}", fmt_shape(&shape)),
            format!("{} bytes ({what})", body.len()),
        ));
    }
    let file = npyz::NpyFile::with_header(header, body);
    let data = match descr.as_str() {
        "<f8" => file.into_vec().map(NpyData::F64),
        "<f4" => file.into_vec().map(NpyData::F32),
        "<i8" => file.into_vec().map(NpyData::I64),
        _ => file.into_vec().map(NpyData::I32),
    }
    .map_err(|e| io(&format!("{count} elements of {descr}"), e.to_string()))?;
    Ok(NpyArray { shape, data })
}

/// Encodes an array as an `.npy` file (through `npyz`: little-endian, C order).
pub fn encode(arr: &NpyArray) -> Result<Vec<u8>, KdaError> {
    fn write<T: npyz::AutoSerialize + Copy>(
        shape: &[u64],
        v: &[T],
        out: &mut Vec<u8>,
    ) -> std::io::Result<()> {
        use npyz::WriterBuilder;
        let mut w = npyz::WriteOptions::new().default_dtype().shape(shape).writer(out).begin_nd()?;
        w.extend(v.iter().copied())?;
        w.finish()
    }
    let shape: Vec<u64> = arr.shape.iter().map(|&d| d as u64).collect();
    let mut out = Vec::with_capacity(128 + arr.data.len() * 8);
    match &arr.data {
        NpyData::F64(v) => write(&shape, v, &mut out),
        NpyData::F32(v) => write(&shape, v, &mut out),
        NpyData::I64(v) => write(&shape, v, &mut out),
        NpyData::I32(v) => write(&shape, v, &mut out),
    }
    .map_err(|e| KdaError::io("npy array", "an encodable array", e.to_string()))?;
    Ok(out)
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
    std::fs::write(path, encode(arr)?)
        .map_err(|e| KdaError::io(path.display().to_string(), "a writable file", e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kda_core::ErrorKind;
    use rstest::rstest;

    fn header_bytes(version: u8, dict: &str) -> Vec<u8> {
        let mut out = b"\x93NUMPY".to_vec();
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
        let bytes = encode(&arr).expect("encodes");
        assert_eq!(&bytes[..6], b"\x93NUMPY");
        assert_eq!(parse(&bytes, "x.npy").expect("parses"), arr);
    }

    #[test]
    fn headers_are_numpy_dicts() {
        let text = |shape: &[usize]| {
            let n = shape.iter().product();
            let arr = NpyArray::new(shape, NpyData::I32(vec![0; n])).expect("ok");
            String::from_utf8_lossy(&encode(&arr).expect("encodes")).into_owned()
        };
        for (shape, tuple) in [(&[][..], "()"), (&[3][..], "(3, )"), (&[2, 3][..], "(2, 3, )")] {
            let t = text(shape);
            assert!(t.contains("'descr': '<i4'") && t.contains("'fortran_order': False"), "{t}");
            assert!(t.contains(&format!("'shape': {tuple}")), "{t}");
        }
    }

    #[rstest]
    #[case::v2(2)]
    #[case::v3(3)]
    fn reads_versions_2_and_3(#[case] version: u8) {
        let mut bytes = header_bytes(version, "{\"descr\":'<f4',\"shape\":(2,),'fortran_order':False}\n");
        bytes.extend_from_slice(&1.0f32.to_le_bytes());
        bytes.extend_from_slice(&(-3.0f32).to_le_bytes());
        let arr = parse(&bytes, "v.npy").expect("parses");
        assert_eq!(arr, NpyArray { shape: vec![2], data: NpyData::F32(vec![1.0, -3.0]) });
    }

    #[rstest]
    #[case::bad_magic(b"\x93NUMPZ\x01\x00\x00\x00".to_vec(), ErrorKind::Io, "magic")]
    #[case::too_short(b"\x93NUM".to_vec(), ErrorKind::Io, "magic")]
    #[case::version_4(header_bytes(4, "{}"), ErrorKind::Io, "unsupported version: (4, 0)")]
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
        ErrorKind::DType,
        "structured"
    )]
    #[case::no_shape(
        header_bytes(1, "{'descr': '<f8', 'fortran_order': False}"),
        ErrorKind::Io,
        "missing key 'shape'"
    )]
    #[case::bad_dict(header_bytes(1, "{'descr' '<f8'}"), ErrorKind::Io, "syntax error")]
    #[case::header_past_end(b"\x93NUMPY\x01\x00\xff\x00{}".to_vec(), ErrorKind::Io, "failed to fill whole buffer")]
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
        let mut bytes = encode(&arr).expect("encodes");
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
