//! The argument and result types of `@main`, read from the StableHLO text we compile.
//! The CPU plugin accepts an i32 buffer where f32 is declared, so inputs are checked against these.

use kda_core::DType;

use crate::hlo::TensorType;

/// `@main`'s argument and result types; `None` entries are types we do not check (dynamic, tuples).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Signature {
    /// One entry per argument.
    pub args: Vec<Option<TensorType>>,
    /// One entry per result.
    pub results: Vec<Option<TensorType>>,
}

impl Signature {
    /// Parses the pretty form `func.func [public] @main(%a: tensor<..> {attrs}, ..) -> (..) {`.
    /// Returns `None` for other syntaxes; the runtime then skips its own checks.
    pub fn parse(text: &str) -> Option<Self> {
        let start = text.find("@main(")? + "@main".len();
        let (args, rest) = balanced(&text[start..])?;
        let rest = rest.trim_start();
        let results = match rest.strip_prefix("->") {
            None => Vec::new(),
            Some(r) => {
                let r = r.trim_start();
                if r.starts_with('(') {
                    split_top(balanced(r)?.0).into_iter().map(tensor_type).collect()
                } else {
                    vec![tensor_type(r.split('{').next()?)]
                }
            }
        };
        let args = split_top(args).into_iter().map(tensor_type).collect();
        Some(Signature { args, results })
    }
}

/// The inside of the bracketed group that `s` starts with, and the text after it.
fn balanced(s: &str) -> Option<(&str, &str)> {
    let mut depth = 0i32;
    for (i, c) in s.char_indices() {
        match c {
            '(' | '<' | '{' | '[' => depth += 1,
            ')' | '>' | '}' | ']' => {
                depth -= 1;
                if depth == 0 {
                    return Some((&s[1..i], &s[i + 1..]));
                }
            }
            _ => {}
        }
    }
    None
}

/// Splits at commas outside any brackets; an empty list gives no pieces.
fn split_top(s: &str) -> Vec<&str> {
    let (mut depth, mut last, mut out) = (0i32, 0, Vec::new());
    for (i, c) in s.char_indices() {
        match c {
            '(' | '<' | '{' | '[' => depth += 1,
            ')' | '>' | '}' | ']' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&s[last..i]);
                last = i + 1;
            }
            _ => {}
        }
    }
    if !s[last..].trim().is_empty() {
        out.push(&s[last..]);
    }
    out
}

/// The first `tensor<DxDxT>` in `piece` (an argument with its name and attributes, or a result).
fn tensor_type(piece: &str) -> Option<TensorType> {
    let at = piece.find("tensor<")? + "tensor".len();
    let (inner, _) = balanced(&piece[at..])?;
    let inner = split_top(inner).into_iter().next()?.trim(); // drop an encoding after a comma
    let mut parts: Vec<&str> = inner.split('x').collect();
    // Element types never contain 'x', so the last piece is the type and the rest are dims.
    let dtype = DType::parse(parts.pop()?.trim())?;
    let dims = parts.iter().map(|d| d.trim().parse::<i64>().ok()).collect::<Option<Vec<_>>>()?;
    Some(TensorType { elem: dtype, dims })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_pretty_main() {
        let text =
            "module @m {\n func.func public @main(%a: tensor<8x64xf32> {tf.aliasing_output = 0 : i32}, \
                    %n: tensor<i32>, %u: tensor<4x?xbf16>) -> (tensor<8x64xf32>, tensor<2xui16>) {\n";
        let sig = Signature::parse(text).expect("signature");
        assert_eq!(sig.args.len(), 3);
        assert_eq!(sig.args[0], Some(TensorType { elem: DType::F32, dims: vec![8, 64] }));
        assert_eq!(sig.args[1], Some(TensorType { elem: DType::I32, dims: vec![] }));
        assert_eq!(sig.args[2], None);
        assert_eq!(sig.results[1], Some(TensorType { elem: DType::U16, dims: vec![2] }));
        let single = Signature::parse("func.func @main() -> tensor<3xi1> {").expect("single");
        assert!(single.args.is_empty());
        assert_eq!(single.results[0].as_ref().map(|t| t.to_string()), Some("tensor<3xi1>".to_string()));
    }
}
