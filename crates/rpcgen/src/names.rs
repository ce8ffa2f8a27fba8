//! Conversion of C identifiers to Rust naming conventions.

/// Rust keywords (strict and reserved, all editions): escaped as raw identifiers.
const KEYWORDS: &[&str] = &[
    "as", "break", "const", "continue", "crate", "else", "enum", "extern", "false", "fn", "for",
    "if", "impl", "in", "let", "loop", "match", "mod", "move", "mut", "pub", "ref", "return",
    "self", "Self", "static", "struct", "super", "trait", "true", "type", "unsafe", "use", "where",
    "while", "async", "await", "dyn", "abstract", "become", "box", "do", "final", "macro",
    "override", "priv", "typeof", "unsized", "virtual", "yield", "try", "gen",
];

/// Keywords that cannot be raw identifiers; they get a trailing underscore instead.
const NOT_RAW: &[&str] = &["self", "Self", "super", "crate", "_"];

/// Type names that generated code uses unqualified (from the prelude); a type converting to
/// one of these is prefixed with `Xdr`.
const RESERVED_TYPES: &[&str] = &[
    "Option", "Box", "Vec", "String", "Result", "Some", "None", "Ok", "Err", "Self",
];

/// Splits a C identifier into lower-case words at underscores and lower-to-upper case
/// changes (`cuMemAlloc_v2` → `cu mem alloc v2`, `NFSPROC_NULL` → `nfsproc null`).
pub(crate) fn words(name: &str) -> Vec<String> {
    let mut out = Vec::new();
    for part in name.split('_').filter(|p| !p.is_empty()) {
        let chars: Vec<char> = part.chars().collect();
        let mut cur = String::new();
        for (i, &c) in chars.iter().enumerate() {
            let boundary = i > 0
                && c.is_ascii_uppercase()
                && (chars[i - 1].is_ascii_lowercase()
                    || chars[i - 1].is_ascii_digit()
                    || (chars[i - 1].is_ascii_uppercase()
                        && chars.get(i + 1).is_some_and(char::is_ascii_lowercase)));
            if boundary && !cur.is_empty() {
                out.push(std::mem::take(&mut cur));
            }
            cur.push(c.to_ascii_lowercase());
        }
        if !cur.is_empty() {
            out.push(cur);
        }
    }
    out
}

fn escape(s: String) -> String {
    if NOT_RAW.contains(&s.as_str()) {
        format!("{s}_")
    } else if KEYWORDS.contains(&s.as_str()) {
        format!("r#{s}")
    } else {
        s
    }
}

/// `UpperCamelCase` for types, enum variants and union variants.
pub(crate) fn camel(name: &str) -> String {
    let mut s: String = words(name)
        .iter()
        .map(|w| {
            let mut c = w.chars();
            c.next()
                .map(|f| f.to_ascii_uppercase().to_string() + c.as_str())
                .unwrap_or_default()
        })
        .collect();
    if s.is_empty() {
        s = "X".to_owned();
    }
    if s.starts_with(|c: char| c.is_ascii_digit()) {
        s.insert(0, 'N');
    }
    s
}

/// A type name: [`camel`], prefixed with `Xdr` where it would shadow a prelude name that
/// generated code uses.
pub(crate) fn type_name(name: &str) -> String {
    let s = camel(name);
    if RESERVED_TYPES.contains(&s.as_str()) {
        format!("Xdr{s}")
    } else {
        s
    }
}

/// `snake_case` for fields, methods and functions, keywords escaped (`type` → `r#type`).
pub(crate) fn snake(name: &str) -> String {
    let mut s = words(name).join("_");
    if s.is_empty() {
        s = "x".to_owned();
    }
    if s.starts_with(|c: char| c.is_ascii_digit()) {
        s.insert(0, 'n');
    }
    escape(s)
}

/// `SCREAMING_SNAKE_CASE` for constants.
pub(crate) fn upper(name: &str) -> String {
    let mut s = words(name).join("_").to_ascii_uppercase();
    if s.is_empty() {
        s = "X".to_owned();
    }
    if s.starts_with(|c: char| c.is_ascii_digit()) {
        s.insert(0, 'N');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Asserts that `convert` turns each first name of `cases` into the second.
    #[track_caller]
    fn converts(convert: fn(&str) -> String, cases: &[(&str, &str)]) {
        for &(from, to) in cases {
            assert_eq!(convert(from), to, "converting {from:?}");
        }
    }

    #[test]
    fn conversions() {
        converts(
            camel,
            &[
                ("nfs_fh", "NfsFh"),
                ("NFS_OK", "NfsOk"),
                ("cudaError_enum", "CudaErrorEnum"),
                ("fattr3", "Fattr3"),
                ("HTTPServer", "HttpServer"),
                ("_private", "Private"),
                ("3d", "N3d"),
            ],
        );
        converts(
            type_name,
            &[("option", "XdrOption"), ("result", "XdrResult")],
        );
        converts(
            snake,
            &[
                ("NFSPROC_GETATTR", "nfsproc_getattr"),
                ("cuMemAlloc_v2", "cu_mem_alloc_v2"),
                ("type", "r#type"),
                ("self", "self_"),
                ("ut_line", "ut_line"),
            ],
        );
        converts(
            upper,
            &[("nis_maxnamelen", "NIS_MAXNAMELEN"), ("maxLen", "MAX_LEN")],
        );
    }
}
