//! Flag parsing shared by the commands: `--flag value`, `--flag=value` and comma lists.

/// `--flag=value` -> (`--flag`, `Some("value")`); anything else -> (`arg`, `None`).
pub fn split(arg: &str) -> (&str, Option<&str>) {
    match arg.split_once('=') {
        Some((f, v)) if f.starts_with("--") => (f, Some(v)),
        _ => (arg, None),
    }
}

/// The value of `flag`: the inline one (`--flag=v`) or the next argument.
pub fn value<'a>(
    flag: &str,
    inline: Option<&'a str>,
    rest: &mut impl Iterator<Item = &'a String>,
) -> Result<&'a str, String> {
    inline.or_else(|| rest.next().map(String::as_str)).ok_or_else(|| format!("`{flag}` needs a value"))
}

/// A switch takes no value: rejects `--switch=x`.
pub fn switch(flag: &str, inline: Option<&str>) -> Result<(), String> {
    match inline {
        Some(v) => Err(format!("`{flag}` takes no value, got `{v}`")),
        None => Ok(()),
    }
}

/// A comma-separated list of names; `all` means every item of `all` (in that order).
pub fn list<T: Copy + PartialEq>(
    flag: &str,
    value: &str,
    all: &[T],
    parse: impl Fn(&str) -> Option<T>,
    expected: &str,
) -> Result<Vec<T>, String> {
    if value == "all" {
        return Ok(all.to_vec());
    }
    let mut out = Vec::new();
    for name in value.split(',') {
        let item = parse(name.trim()).ok_or_else(|| {
            format!("`{flag}`: expected {expected} (or a comma list, or all), got `{name}`")
        })?;
        if !out.contains(&item) {
            out.push(item);
        }
    }
    Ok(out)
}

/// `f32`, `bf16` or `both` (f32 then bf16); f64 is not a kernel dtype.
pub fn dtypes(flag: &str, value: &str) -> Result<Vec<kda_core::DType>, String> {
    use kda_core::DType;
    match value {
        "both" | "all" => Ok(vec![DType::F32, DType::BF16]),
        "f32" => Ok(vec![DType::F32]),
        "bf16" => Ok(vec![DType::BF16]),
        other => Err(format!("`{flag}`: expected f32, bf16 or both, got `{other}`")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    #[rstest]
    #[case("--iterations=5", "--iterations", Some("5"))]
    #[case("--iterations", "--iterations", None)]
    #[case("-h", "-h", None)]
    #[case("x=y", "x=y", None)]
    fn split_inline_values(#[case] arg: &str, #[case] flag: &str, #[case] inline: Option<&str>) {
        assert_eq!(split(arg), (flag, inline));
    }

    #[test]
    fn lists_dedupe_and_expand_all() {
        let parse = |s: &str| ["a", "b", "c"].iter().position(|x| *x == s);
        assert_eq!(list("--x", "c,a,c", &[0, 1, 2], parse, "a, b or c"), Ok(vec![2, 0]));
        assert_eq!(list("--x", "all", &[0, 1, 2], parse, "a, b or c"), Ok(vec![0, 1, 2]));
        let err = list("--x", "a,d", &[0, 1, 2], parse, "a, b or c").unwrap_err();
        assert!(err.contains("got `d`"), "{err}");
    }
}
