//! Flag parsing shared by the commands, on `lexopt`: `--flag value`, `--flag=value`, switches,
//! positional names and `--`, with the commands' own error messages, plus comma lists.

use lexopt::Arg;

/// The names `--implementation` takes, for errors.
pub const IMPLEMENTATIONS: &str = "xla, mosaic, interpret, triton or triton-interpret";

/// One command-line item.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Item {
    /// `--flag` or `-f`, as typed (a value, if any, is read with [`Flags::value`]).
    Flag(String),
    /// A positional argument.
    Name(String),
}

/// The arguments of one command (after the command's name).
pub struct Flags {
    parser: lexopt::Parser,
}

impl Flags {
    /// Parses `args`.
    pub fn new(args: &[String]) -> Self {
        Flags { parser: lexopt::Parser::from_args(args.iter().cloned()) }
    }

    /// The next flag or name; `--switch=value` is an error naming the switch.
    pub fn next(&mut self) -> Result<Option<Item>, String> {
        match self.parser.next() {
            Ok(None) => Ok(None),
            Ok(Some(Arg::Long(name))) => Ok(Some(Item::Flag(format!("--{name}")))),
            Ok(Some(Arg::Short(c))) => Ok(Some(Item::Flag(format!("-{c}")))),
            Ok(Some(Arg::Value(v))) => Ok(Some(Item::Name(v.to_string_lossy().into_owned()))),
            Err(lexopt::Error::UnexpectedValue { option, value }) => {
                Err(format!("`{option}` takes no value, got `{}`", value.to_string_lossy()))
            }
            Err(e) => Err(e.to_string()),
        }
    }

    /// The next flag, for commands that take no positional names (one is an error naming it).
    pub fn next_flag(&mut self) -> Result<Option<String>, String> {
        match self.next()? {
            None => Ok(None),
            Some(Item::Flag(flag)) => Ok(Some(flag)),
            Some(Item::Name(name)) => Err(format!("unknown argument `{name}`")),
        }
    }

    /// The value of `flag`: the inline one (`--flag=v`) or the next argument.
    pub fn value(&mut self, flag: &str) -> Result<String, String> {
        match self.parser.value() {
            Ok(v) => Ok(v.to_string_lossy().into_owned()),
            Err(_) => Err(format!("`{flag}` needs a value")),
        }
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

/// A count of 1 or more given to `flag`.
pub fn positive(flag: &str, v: &str) -> Result<usize, String> {
    match v.parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("`{flag}` needs a positive whole number, got `{v}`")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    fn items(args: &str) -> Result<Vec<(Item, Option<String>)>, String> {
        let args: Vec<String> = args.split_whitespace().map(String::from).collect();
        let mut f = Flags::new(&args);
        let mut out = Vec::new();
        while let Some(item) = f.next()? {
            let v = match &item {
                Item::Flag(flag) if flag == "--iterations" => Some(f.value(flag)?),
                _ => None,
            };
            out.push((item, v));
        }
        Ok(out)
    }

    #[rstest]
    #[case("--iterations=5", Item::Flag("--iterations".into()), Some("5"))]
    #[case("--iterations 5", Item::Flag("--iterations".into()), Some("5"))]
    #[case("-h", Item::Flag("-h".into()), None)]
    #[case("x=y", Item::Name("x=y".into()), None)]
    fn flags_values_and_names(#[case] args: &str, #[case] item: Item, #[case] value: Option<&str>) {
        assert_eq!(items(args), Ok(vec![(item, value.map(String::from))]));
    }

    #[rstest]
    #[case("--iterations", "`--iterations` needs a value")]
    #[case("--full=yes", "`--full` takes no value, got `yes`")]
    fn flag_errors_name_the_flag(#[case] args: &str, #[case] message: &str) {
        assert_eq!(items(args).unwrap_err(), message);
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
