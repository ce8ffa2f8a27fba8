//! The lexer: turns one file's text into tokens, `#` directive lines and `@oneway` marks.

use std::fmt;

use crate::error::Pos;

/// A token kind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Tok {
    Ident(String),
    /// An unsigned integer literal; `hex` records how it was written.
    Num {
        value: u64,
        hex: bool,
    },
    Punct(char),
    /// A string literal (only meaningful as a `const` value).
    Str(String),
    /// A `#` line, without the `#`, comments removed and continuations joined.
    Directive(String),
    /// A `%#include` pass-through line naming a C header (the header's path).
    PassInclude(String),
    /// Start and end of the types imported from a sibling `.x` file.
    ImportStart,
    ImportEnd,
    Eof,
}

impl fmt::Display for Tok {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Tok::Ident(s) => write!(f, "identifier '{s}'"),
            Tok::Num { value, .. } => write!(f, "number {value}"),
            Tok::Punct(c) => write!(f, "'{c}'"),
            Tok::Str(s) => write!(f, "string \"{s}\""),
            Tok::Directive(d) => write!(f, "directive '#{}'", d.trim()),
            Tok::PassInclude(h) => write!(f, "'%#include {h}'"),
            Tok::ImportStart | Tok::ImportEnd => f.write_str("imported definitions"),
            Tok::Eof => f.write_str("end of input"),
        }
    }
}

/// A token and where it starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Token {
    pub(crate) tok: Tok,
    pub(crate) pos: Pos,
    /// A comment containing `@oneway` came right before this token.
    pub(crate) oneway: bool,
}

const PUNCT: &str = "{}()[]<>;,=*:-";

struct Lexer<'a> {
    src: &'a [u8],
    i: usize,
    line: u32,
    col: u32,
    file: u32,
    line_start: bool,
    oneway: bool,
    /// Values of `%#define NAME value` lines seen so far.
    pass_defines: std::collections::HashMap<String, i64>,
}

impl Lexer<'_> {
    fn pos(&self) -> Pos {
        Pos {
            file: self.file,
            line: self.line,
            col: self.col,
        }
    }

    fn peek(&self, k: usize) -> Option<u8> {
        self.src.get(self.i + k).copied()
    }

    fn bump(&mut self) -> Option<u8> {
        let c = self.src.get(self.i).copied()?;
        self.i += 1;
        if c == b'\n' {
            self.line += 1;
            self.col = 1;
            self.line_start = true;
        } else if c & 0xC0 != 0x80 {
            // Count characters, not UTF-8 continuation bytes.
            self.col += 1;
        }
        Some(c)
    }

    /// Skips a `/* */` comment whose `/*` is next; returns its text.
    fn block_comment(&mut self) -> Result<String, (Pos, String)> {
        let start = self.pos();
        self.bump();
        self.bump();
        let from = self.i;
        loop {
            match self.peek(0) {
                None => return Err((start, "unterminated comment: expected '*/'".to_owned())),
                Some(b'*') if self.peek(1) == Some(b'/') => {
                    let text = String::from_utf8_lossy(&self.src[from..self.i]).into_owned();
                    self.bump();
                    self.bump();
                    return Ok(text);
                }
                Some(_) => {
                    self.bump();
                }
            }
        }
    }

    fn line_comment(&mut self) -> String {
        let from = self.i;
        while let Some(c) = self.peek(0) {
            if c == b'\n' {
                break;
            }
            self.bump();
        }
        String::from_utf8_lossy(&self.src[from..self.i]).into_owned()
    }

    /// Reads a directive line after its `#`.
    fn directive(&mut self) -> Result<String, (Pos, String)> {
        let mut out = Vec::new();
        loop {
            match self.peek(0) {
                None | Some(b'\n') => break,
                Some(b'\\') if self.peek(1) == Some(b'\n') => {
                    self.bump();
                    self.bump();
                    out.push(b' ');
                }
                Some(b'\\') if self.peek(1) == Some(b'\r') && self.peek(2) == Some(b'\n') => {
                    self.bump();
                    self.bump();
                    self.bump();
                    out.push(b' ');
                }
                Some(b'/') if self.peek(1) == Some(b'*') => {
                    self.block_comment()?;
                    out.push(b' ');
                }
                Some(b'/') if self.peek(1) == Some(b'/') => {
                    self.line_comment();
                }
                Some(c) => {
                    self.bump();
                    out.push(c);
                }
            }
        }
        Ok(String::from_utf8_lossy(&out).into_owned())
    }

    fn number(&mut self) -> Result<Tok, (Pos, String)> {
        let start = self.pos();
        let from = self.i;
        while self
            .peek(0)
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == b'_')
        {
            self.bump();
        }
        let text = std::str::from_utf8(&self.src[from..self.i]).unwrap_or("");
        parse_number(text)
            .map(|(value, hex)| Tok::Num { value, hex })
            .map_err(|m| (start, m))
    }

    fn run(mut self) -> Result<Vec<Token>, (Pos, String)> {
        let mut out = Vec::new();
        while let Some(c) = self.peek(0) {
            match c {
                b'\n' => {
                    self.bump();
                }
                c if c.is_ascii_whitespace() => {
                    self.bump();
                }
                b'/' if self.peek(1) == Some(b'*') => {
                    if self.block_comment()?.contains("@oneway") {
                        self.oneway = true;
                    }
                }
                b'/' if self.peek(1) == Some(b'/') => {
                    if self.line_comment().contains("@oneway") {
                        self.oneway = true;
                    }
                }
                b'%' if self.line_start => {
                    // rpcgen pass-through line: meaningful to C output only, except that a
                    // `%#include` of a header generated from a sibling `.x` file imports it.
                    let pos = self.pos();
                    self.bump();
                    let text = self.directive()?;
                    let t = text.trim();
                    if let Some(rest) = t.strip_prefix('#').map(str::trim_start) {
                        if let Some(def) = rest.strip_prefix("define") {
                            // `%#define NAME 1024` (or an integer expression over earlier
                            // ones): a C constant the file may use as a bound; it becomes a
                            // `const`.
                            let def = def.trim();
                            let end = def
                                .find(|c: char| !c.is_ascii_alphanumeric() && c != '_')
                                .unwrap_or(def.len());
                            let (name, body) = (&def[..end], def[end..].trim());
                            let ident =
                                name.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_');
                            let value = crate::pp::eval_simple(body, &self.pass_defines);
                            if ident
                                && !def[end..].starts_with('(')
                                && let Some(value) = value
                                && let Ok(v) = u64::try_from(value)
                            {
                                self.pass_defines.insert(name.to_owned(), value);
                                for tok in [
                                    Tok::Ident("const".into()),
                                    Tok::Ident(name.into()),
                                    Tok::Punct('='),
                                    Tok::Num {
                                        value: v,
                                        hex: body.starts_with("0x"),
                                    },
                                    Tok::Punct(';'),
                                ] {
                                    out.push(Token {
                                        tok,
                                        pos,
                                        oneway: false,
                                    });
                                }
                            }
                        }
                        if let Some(h) = rest.strip_prefix("include") {
                            let h = h.trim();
                            if h.len() > 2 {
                                out.push(Token {
                                    tok: Tok::PassInclude(h[1..h.len() - 1].to_owned()),
                                    pos,
                                    oneway: false,
                                });
                            }
                        }
                    }
                }
                b'#' if self.line_start => {
                    let pos = self.pos();
                    self.bump();
                    let text = self.directive()?;
                    out.push(Token {
                        tok: Tok::Directive(text),
                        pos,
                        oneway: false,
                    });
                }
                _ => {
                    self.line_start = false;
                    let pos = self.pos();
                    let tok = if c.is_ascii_alphabetic() || c == b'_' {
                        let from = self.i;
                        while self
                            .peek(0)
                            .is_some_and(|c| c.is_ascii_alphanumeric() || c == b'_')
                        {
                            self.bump();
                        }
                        Tok::Ident(String::from_utf8_lossy(&self.src[from..self.i]).into_owned())
                    } else if c.is_ascii_digit() {
                        self.number()?
                    } else if c == b'"' {
                        self.bump();
                        let from = self.i;
                        loop {
                            match self.peek(0) {
                                None | Some(b'\n') => {
                                    return Err((
                                        pos,
                                        "unterminated string literal: expected '\"'".to_owned(),
                                    ));
                                }
                                Some(b'"') => break,
                                Some(b'\\') => {
                                    self.bump();
                                    self.bump();
                                }
                                Some(_) => {
                                    self.bump();
                                }
                            }
                        }
                        let text = String::from_utf8_lossy(&self.src[from..self.i]).into_owned();
                        self.bump();
                        Tok::Str(text)
                    } else if PUNCT.as_bytes().contains(&c) {
                        self.bump();
                        Tok::Punct(char::from(c))
                    } else {
                        let ch = std::str::from_utf8(&self.src[self.i..])
                            .ok()
                            .and_then(|s| s.chars().next())
                            .unwrap_or(char::from(c));
                        return Err((pos, format!("unexpected character '{ch}'")));
                    };
                    out.push(Token {
                        tok,
                        pos,
                        oneway: std::mem::take(&mut self.oneway),
                    });
                }
            }
        }
        out.push(Token {
            tok: Tok::Eof,
            pos: self.pos(),
            oneway: false,
        });
        Ok(out)
    }
}

/// Parses a C integer literal: decimal, `0x` hex or leading-zero octal.
pub(crate) fn parse_number(text: &str) -> Result<(u64, bool), String> {
    let lower = text.to_ascii_lowercase();
    // Accept (and ignore) C suffixes such as `U`, `L`, `UL`.
    let digits = lower.trim_end_matches(['u', 'l']);
    let (radix, body, hex) = if let Some(h) = digits.strip_prefix("0x") {
        (16, h, true)
    } else if digits.len() > 1 && digits.starts_with('0') {
        (8, &digits[1..], false)
    } else {
        (10, digits, false)
    };
    if body.is_empty() || !body.chars().all(|c| c.is_digit(radix)) {
        return Err(format!("invalid number '{text}'"));
    }
    u64::from_str_radix(body, radix)
        .map(|v| (v, hex))
        .map_err(|_| format!("number '{text}' does not fit in 64 bits"))
}

/// Lexes one file's text.
pub(crate) fn lex(src: &str, file: u32) -> Result<Vec<Token>, (Pos, String)> {
    lex_with(src, file, true)
}

/// Lexes a macro's replacement text (no directives in it).
pub(crate) fn lex_fragment(src: &str, file: u32) -> Result<Vec<Token>, (Pos, String)> {
    lex_with(src, file, false)
}

fn lex_with(src: &str, file: u32, line_start: bool) -> Result<Vec<Token>, (Pos, String)> {
    Lexer {
        src: src.as_bytes(),
        i: 0,
        line: 1,
        col: 1,
        file,
        line_start,
        oneway: false,
        pass_defines: std::collections::HashMap::new(),
    }
    .run()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(s: &str) -> Vec<Tok> {
        lex(s, 0).unwrap().into_iter().map(|t| t.tok).collect()
    }

    #[test]
    fn numbers() {
        assert_eq!(parse_number("0x1F"), Ok((31, true)));
        assert_eq!(parse_number("017"), Ok((15, false)));
        assert_eq!(parse_number("0"), Ok((0, false)));
        assert_eq!(parse_number("42"), Ok((42, false)));
        assert!(parse_number("08").is_err());
        assert!(parse_number("99999999999999999999999").is_err());
    }

    #[test]
    fn tokens_comments_and_passthrough() {
        let t = toks("const A = 0x10; /* c */ // d\n% pass through\nint b<>;");
        assert_eq!(
            t,
            vec![
                Tok::Ident("const".into()),
                Tok::Ident("A".into()),
                Tok::Punct('='),
                Tok::Num {
                    value: 16,
                    hex: true
                },
                Tok::Punct(';'),
                Tok::Ident("int".into()),
                Tok::Ident("b".into()),
                Tok::Punct('<'),
                Tok::Punct('>'),
                Tok::Punct(';'),
                Tok::Eof
            ]
        );
    }

    #[test]
    fn directives_and_positions() {
        let t = lex("  #define X 1 /* c */ \\\n  + 2\nfoo", 3).unwrap();
        let Tok::Directive(d) = &t[0].tok else {
            panic!("not a directive")
        };
        assert_eq!(
            d.split_whitespace().collect::<Vec<_>>(),
            ["define", "X", "1", "+", "2"]
        );
        assert_eq!(t[1].tok, Tok::Ident("foo".into()));
        assert_eq!((t[1].pos.file, t[1].pos.line, t[1].pos.col), (3, 3, 1));
    }

    #[test]
    fn oneway_mark() {
        let t = lex("/* @oneway */ void f(int) = 1; int", 0).unwrap();
        assert!(t[0].oneway);
        assert!(!t[1].oneway);
    }

    #[test]
    fn bad_character() {
        let e = lex("int a;\n  $", 0).unwrap_err();
        assert_eq!((e.0.line, e.0.col), (2, 3));
        assert_eq!(e.1, "unexpected character '$'");
    }
}
