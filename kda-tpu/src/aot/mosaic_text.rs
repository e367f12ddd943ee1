//! What a program's Mosaic kernels ask of a TensorCore before libtpu compiles them: each
//! kernel's text (the base64 body of its `tpu_custom_call`) counted in vector-register ops by
//! class. The listing's counts after libtpu are [`super::cycles::Units`]; these are the
//! basis of the estimates a change to a kernel's body is planned on
//! (docs/kernels/static-cycles.md, "Counts of the Mosaic text").

use crate::error::{Result, TpuError};

/// A kernel's Mosaic text in vector-register ops (a `[64, 128]` f32 array is 8, bf16 4; masks
/// count as 32-bit), once per grid step: the body as written, each op once (a region's
/// insides once too).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TextCounts {
    /// The kernel's name.
    pub name: String,
    /// Vector ALU arithmetic: `arith` ops on vectors (compares and selects included), but
    /// conversions and constants.
    pub valu: u64,
    /// f32/bf16 and int/float conversions (`arith.truncf`, `extf`, `sitofp`, `fptosi`).
    pub conversions: u64,
    /// Transcendental ops (`math.*`).
    pub transcendental: u64,
    /// Products (`tpu.matmul`), in registers of their results.
    pub products: u64,
    /// Relayouts and cross-lane work: broadcasts, reductions, transposes, slices, reshapes,
    /// concatenations.
    pub layout: u64,
    /// Vector loads and stores.
    pub loads: u64,
    /// Vector stores.
    pub stores: u64,
    /// Vector constants.
    pub constants: u64,
}

/// The Mosaic kernels of a StableHLO `program`: each `tpu_custom_call`'s kernel name and text,
/// in the program's order.
pub fn kernel_texts(program: &str) -> Result<Vec<(String, String)>> {
    const BODY: &str = "\\\"body\\\": \\\"";
    const NAME: &str = "kernel_name = \"";
    let mut out = vec![];
    let mut rest = program;
    while let Some(at) = rest.find(BODY) {
        rest = &rest[at + BODY.len()..];
        let end = rest.find('\\').ok_or_else(|| bad("an unterminated kernel body"))?;
        let text =
            String::from_utf8(decode_base64(&rest[..end])?).map_err(|_| bad("a kernel body not UTF-8"))?;
        let name = rest
            .find(NAME)
            .and_then(|n| rest[n + NAME.len()..].split('"').next())
            .ok_or_else(|| bad("a custom call without a kernel name"))?;
        out.push((name.to_string(), text));
    }
    Ok(out)
}

/// The counts of one kernel's Mosaic `text`.
pub fn count(name: &str, text: &str) -> TextCounts {
    let mut c = TextCounts { name: name.to_string(), ..TextCounts::default() };
    for line in text.lines() {
        let line = line.trim_start();
        // `%x = op ...` or, for an op without results, `op ...` (whose attributes may hold ` = `).
        let op = match line.split_once(" = ") {
            Some((_, rhs)) if line.starts_with('%') => rhs.split_whitespace().next().unwrap_or(""),
            _ => line.split_whitespace().next().unwrap_or(""),
        };
        // The generic form: `"dialect.op"(operands)`.
        let op = op.trim_start_matches('"').split('"').next().unwrap_or("");
        let Some(regs) = line.rfind("vector<").map(|at| vregs(&line[at + "vector<".len()..])) else {
            continue;
        };
        let (dialect, name) = op.split_once('.').unwrap_or(("", op));
        let slot = match (dialect, name) {
            ("arith", "truncf" | "extf" | "sitofp" | "fptosi") => &mut c.conversions,
            ("arith", "constant") => &mut c.constants,
            ("arith", _) => &mut c.valu,
            ("math", _) => &mut c.transcendental,
            ("tpu", "matmul") => &mut c.products,
            ("vector", "load") | ("tpu", "load" | "strided_load") => &mut c.loads,
            ("vector", "store") | ("tpu", "vector_store" | "store" | "strided_store") => &mut c.stores,
            ("vector", _) | ("tpu", "transpose" | "concatenate" | "iota" | "repeat") => &mut c.layout,
            _ => continue,
        };
        *slot += regs;
    }
    c
}

/// Vector registers of the vector type whose text starts at `ty` (`64x128xf32>`): 8 x 128 of
/// a 32-bit (or narrower mask) type a register, 16 x 128 of a 16-bit one.
fn vregs(ty: &str) -> u64 {
    let ty = ty.split('>').next().unwrap_or("");
    let parts: Vec<&str> = ty.split('x').collect();
    let Some((elem, dims)) = parts.split_last() else { return 0 };
    let dims: Vec<u64> = dims.iter().filter_map(|d| d.parse().ok()).collect();
    let Some((&lanes, rows)) = dims.split_last() else { return 1 };
    let rows: u64 = rows.iter().product();
    let per = if elem.ends_with("16") { 16 } else { 8 };
    rows.div_ceil(per).max(1) * lanes.div_ceil(128).max(1)
}

fn bad(what: &str) -> TpuError {
    TpuError::builder("mosaic text", what.to_string())
}

/// Standard base64 (RFC 4648, padded) back to bytes.
fn decode_base64(s: &str) -> Result<Vec<u8>> {
    let value = |c: u8| -> Result<u32> {
        Ok(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return Err(bad("a kernel body not in base64")),
        } as u32)
    };
    let bytes = s.trim_end_matches('=').as_bytes();
    let mut out = Vec::with_capacity(bytes.len() * 3 / 4);
    for chunk in bytes.chunks(4) {
        let mut n = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            n |= value(c)? << (18 - 6 * i);
        }
        let keep = chunk.len().saturating_sub(1);
        out.extend(n.to_be_bytes()[1..].iter().take(keep));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::{count, decode_base64, kernel_texts, vregs};
    use crate::lang::lower::mosaic::base64;
    use rstest::rstest;

    #[rstest]
    #[case::f32_tile("64x128xf32>", 8)]
    #[case::bf16_tile("64x128xbf16>", 4)]
    #[case::mask("64x64xi1>", 8)]
    #[case::row("1x128xf32>", 1)]
    #[case::stacked("1x1x64x64xbf16>", 4)]
    #[case::wide("64x448xbf16>", 16)]
    fn registers_follow_the_tiling(#[case] ty: &str, #[case] want: u64) {
        assert_eq!(vregs(ty), want);
    }

    #[rstest]
    #[case::empty(b"")]
    #[case::one(b"a")]
    #[case::two(b"ab")]
    #[case::three(b"abc")]
    #[case::text(b"%0 = arith.addf %a, %b : vector<64x128xf32>\n")]
    fn base64_round_trips(#[case] bytes: &[u8]) {
        assert_eq!(decode_base64(&base64(bytes)).expect("decodes"), bytes);
    }

    /// A hand-written body: each op counted in its class, in the registers of its result (a
    /// store in those of the value stored), scalars and index arithmetic not at all.
    #[test]
    fn ops_count_in_their_class() {
        let text = "\
            %c0 = arith.constant 0 : index\n\
            %0 = vector.load %arg1[%c0, %c0] : memref<64x128xf32, #tpu.memory_space<vmem>>, vector<64x128xf32>\n\
            %1 = arith.mulf %0, %0 : vector<64x128xf32>\n\
            %2 = arith.cmpf ogt, %1, %0 : vector<64x128xf32>\n\
            %3 = arith.select %2, %1, %0 : vector<64x128xi1>, vector<64x128xf32>\n\
            %4 = arith.truncf %3 : vector<64x128xf32> to vector<64x128xbf16>\n\
            %5 = math.exp2 %1 : vector<64x128xf32>\n\
            %cst = arith.constant dense<0.0> : vector<64x128xf32>\n\
            %6 = tpu.matmul %4, %4, %cst {dimension_numbers = #tpu.dot_dimension_numbers<[1], [1], [0], [0], [0, 0, 1, 0], [], []>} : vector<64x128xbf16>, vector<64x128xbf16>, vector<64x64xf32> -> vector<64x64xf32>\n\
            %7 = vector.broadcast %s : f32 to vector<64x128xf32>\n\
            %9 = \"vector.extract_strided_slice\"(%7) <{offsets = [0, 0], sizes = [8, 128], strides = [1, 1]}> : (vector<64x128xf32>) -> vector<8x128xf32>\n\
            %8 = arith.addi %i, %j : i32\n\
            tpu.vector_store %arg2[%c0, %c0], %5 {strides = array<i32>} : memref<64x128xf32, #tpu.memory_space<vmem>>, vector<64x128xf32>,\n";
        let c = count("k", text);
        assert_eq!((c.valu, c.conversions, c.transcendental, c.products), (24, 4, 8, 8));
        assert_eq!((c.layout, c.loads, c.stores, c.constants), (9, 8, 8, 8));
        let program = format!(
            "%r = stablehlo.custom_call @tpu_custom_call() {{backend_config = \"{{\\\"custom_call_config\\\": {{\\\"body\\\": \\\"{}\\\", \\\"needs_layout_passes\\\": true}}}}\", kernel_name = \"k\"}}",
            base64(text.as_bytes())
        );
        let kernels = kernel_texts(&program).expect("the program's kernels");
        assert_eq!(kernels, vec![("k".to_string(), text.to_string())]);
    }
}
