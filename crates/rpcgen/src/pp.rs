//! A small C preprocessor: `#include "file"`, object-like `#define`/`#undef`, conditionals
//! (`#ifdef`, `#ifndef`, `#if`, `#elif`, `#else`, `#endif`) with integer expressions; `#pragma`,
//! `#ident` and line markers (`# 12 "file"`) are ignored.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use crate::error::{Error, Files, Pos, Result, SourceFile};
use crate::lex::{Tok, Token, lex, lex_fragment};

const MAX_INCLUDE_DEPTH: usize = 64;
const MAX_EXPANSION_DEPTH: usize = 64;

/// Runs the preprocessor and collects the tokens of the whole translation unit.
pub(crate) struct Preprocessor {
    pub(crate) files: Files,
    defines: HashMap<String, String>,
    out: Vec<Token>,
    /// Virtual files (tests and in-memory sources), looked up before the file system.
    virtual_files: HashMap<PathBuf, String>,
    /// Files being read (include stack) and files already imported through `%#include`.
    active: Vec<PathBuf>,
    imported: HashSet<PathBuf>,
}

struct Cond {
    /// Whether the current branch is being read.
    active: bool,
    /// Whether some branch of this conditional was already taken.
    taken: bool,
    /// Whether the enclosing region is active.
    parent: bool,
    seen_else: bool,
    pos: Pos,
}

impl Cond {
    /// An `#if`/`#ifdef`/`#ifndef` at `pos` whose condition is `value`, inside a region
    /// that is `parent`-active.
    fn open(parent: bool, value: bool, pos: Pos) -> Self {
        Cond {
            active: parent && value,
            taken: value,
            parent,
            seen_else: false,
            pos,
        }
    }
}

impl Preprocessor {
    pub(crate) fn new(
        defines: &[(String, Option<String>)],
        virtual_files: HashMap<PathBuf, String>,
    ) -> Self {
        Self {
            files: Files::default(),
            defines: defines
                .iter()
                .map(|(k, v)| (k.clone(), v.clone().unwrap_or_else(|| "1".to_owned())))
                .collect(),
            out: Vec::new(),
            virtual_files,
            active: Vec::new(),
            imported: HashSet::new(),
        }
    }

    /// Preprocesses `path` (named `display` in messages) and returns all tokens, ending with
    /// one `Eof`.
    pub(crate) fn run(mut self, path: &Path, display: String) -> Result<(Files, Vec<Token>)> {
        self.file(path, display, None, 0)?;
        let pos = self.out.last().map(|t| t.pos).unwrap_or_default();
        self.out.push(Token {
            tok: Tok::Eof,
            pos,
            oneway: false,
        });
        Ok((self.files, self.out))
    }

    fn read(&self, path: &Path) -> std::io::Result<String> {
        match self.virtual_files.get(path) {
            Some(s) => Ok(s.clone()),
            None => std::fs::read_to_string(path),
        }
    }

    fn file(
        &mut self,
        path: &Path,
        display: String,
        included_from: Option<Pos>,
        depth: usize,
    ) -> Result<()> {
        let text = match self.read(path) {
            Ok(t) => t,
            Err(e) => {
                return Err(match included_from {
                    Some(p) => self.files.diag(
                        p,
                        format!("cannot read included file '{}': {e}", path.display()),
                    ),
                    None => Error::io("reading", path, e),
                });
            }
        };
        let index = u32::try_from(self.files.files.len()).unwrap_or(u32::MAX);
        self.files.files.push(SourceFile {
            display,
            path: path.to_path_buf(),
            included_from,
        });
        let tokens = lex(&text, index).map_err(|(p, m)| self.files.diag(p, m))?;
        self.active.push(path.to_path_buf());
        self.imported.insert(path.to_path_buf());
        let mut conds: Vec<Cond> = Vec::new();
        for token in tokens {
            let active = conds.last().is_none_or(|c| c.active);
            match token.tok {
                Tok::Eof => break,
                Tok::Directive(ref text) => {
                    self.directive(text, token.pos, &mut conds, path, depth)?;
                }
                Tok::PassInclude(ref header) if active => {
                    self.pass_include(header, token.pos, path, depth)?;
                }
                Tok::Ident(ref name) if active && self.defines.contains_key(name) => {
                    let mut hide = HashSet::new();
                    self.expand(name, token.pos, token.oneway, &mut hide, 0)?;
                }
                _ if active => self.out.push(token),
                _ => {}
            }
        }
        if let Some(c) = conds.last() {
            return Err(self.files.diag(
                c.pos,
                "unterminated conditional directive: expected '#endif' before end of file",
            ));
        }
        self.active.pop();
        Ok(())
    }

    /// `%#include <dir/NAME.h>` or `%#include "NAME.h"`: when `NAME.x` sits next to the
    /// including file, C users get its types from the header rpcgen generated from it, so its
    /// constants and types (not its programs) are imported.
    fn pass_include(&mut self, header: &str, pos: Pos, path: &Path, depth: usize) -> Result<()> {
        let Some(stem) = Path::new(header).file_stem() else {
            return Ok(());
        };
        if Path::new(header).extension().is_none_or(|e| e != "h") {
            return Ok(());
        }
        let parent = path.parent().unwrap_or(Path::new(""));
        let sibling = parent.join(stem).with_extension("x");
        let known = self.virtual_files.contains_key(&sibling) || sibling.is_file();
        if !known
            || self.imported.contains(&sibling)
            || self.active.contains(&sibling)
            || depth + 1 >= MAX_INCLUDE_DEPTH
        {
            return Ok(());
        }
        let display = sibling.display().to_string();
        self.out.push(Token {
            tok: Tok::ImportStart,
            pos,
            oneway: false,
        });
        self.file(&sibling, display, Some(pos), depth + 1)?;
        self.out.push(Token {
            tok: Tok::ImportEnd,
            pos,
            oneway: false,
        });
        Ok(())
    }

    fn expand(
        &mut self,
        name: &str,
        pos: Pos,
        oneway: bool,
        hide: &mut HashSet<String>,
        depth: usize,
    ) -> Result<()> {
        if depth > MAX_EXPANSION_DEPTH {
            return Err(self
                .files
                .diag(pos, format!("macro '{name}' expands too deeply")));
        }
        let value = self.defines.get(name).cloned().unwrap_or_default();
        let toks = lex_fragment(&value, pos.file).map_err(|(_, m)| {
            self.files
                .diag(pos, format!("in expansion of macro '{name}': {m}"))
        })?;
        hide.insert(name.to_owned());
        let mut first = true;
        for t in toks {
            match t.tok {
                Tok::Eof => break,
                Tok::Ident(ref n) if !hide.contains(n) && self.defines.contains_key(n) => {
                    self.expand(n, pos, oneway && first, hide, depth + 1)?;
                }
                tok => self.out.push(Token {
                    tok,
                    pos,
                    oneway: oneway && first,
                }),
            }
            first = false;
        }
        hide.remove(name);
        Ok(())
    }

    fn directive(
        &mut self,
        text: &str,
        pos: Pos,
        conds: &mut Vec<Cond>,
        path: &Path,
        depth: usize,
    ) -> Result<()> {
        let text = text.trim();
        let (name, rest) = match text.find(|c: char| !c.is_ascii_alphanumeric() && c != '_') {
            Some(i) => (&text[..i], text[i..].trim()),
            None => (text, ""),
        };
        let active = conds.last().is_none_or(|c| c.active);
        match name {
            "ifdef" | "ifndef" => {
                let value = if active {
                    let id = single_ident(rest).ok_or_else(|| {
                        self.files.diag(
                            pos,
                            format!("expected a macro name after '#{name}', found '{rest}'"),
                        )
                    })?;
                    self.defines.contains_key(id) == (name == "ifdef")
                } else {
                    false
                };
                conds.push(Cond::open(active, value, pos));
            }
            "if" => {
                let value = active && self.eval(rest, pos, "#if")? != 0;
                conds.push(Cond::open(active, value, pos));
            }
            "elif" => {
                let Some(c) = conds.last() else {
                    return Err(self.files.diag(pos, "'#elif' without a matching '#if'"));
                };
                if c.seen_else {
                    return Err(self.files.diag(pos, "'#elif' after '#else'"));
                }
                let (parent, taken) = (c.parent, c.taken);
                let value = parent && !taken && self.eval(rest, pos, "#elif")? != 0;
                if let Some(c) = conds.last_mut() {
                    c.active = value;
                    c.taken |= value;
                }
            }
            "else" => {
                let Some(c) = conds.last_mut() else {
                    return Err(self.files.diag(pos, "'#else' without a matching '#if'"));
                };
                if c.seen_else {
                    return Err(self.files.diag(pos, "a second '#else' for the same '#if'"));
                }
                c.seen_else = true;
                c.active = c.parent && !c.taken;
                c.taken = true;
            }
            "endif" => {
                if conds.pop().is_none() {
                    return Err(self.files.diag(pos, "'#endif' without a matching '#if'"));
                }
            }
            _ if !active => {}
            "define" => {
                let end = rest
                    .find(|c: char| !c.is_ascii_alphanumeric() && c != '_')
                    .unwrap_or(rest.len());
                let id = &rest[..end];
                if single_ident(id).is_none() {
                    return Err(self.files.diag(
                        pos,
                        format!("expected a macro name after '#define', found '{rest}'"),
                    ));
                }
                if rest[end..].starts_with('(') {
                    return Err(self.files.diag(
                        pos,
                        format!("function-like macro '{id}' is not supported; only object-like '#define NAME value'"),
                    ));
                }
                self.defines
                    .insert(id.to_owned(), rest[end..].trim().to_owned());
            }
            "undef" => {
                let id = single_ident(rest).ok_or_else(|| {
                    self.files.diag(
                        pos,
                        format!("expected a macro name after '#undef', found '{rest}'"),
                    )
                })?;
                self.defines.remove(id);
            }
            "include" => {
                let file = rest
                    .strip_prefix('"')
                    .and_then(|r| r.strip_suffix('"'))
                    .ok_or_else(|| {
                        self.files.diag(
                            pos,
                            format!("expected '#include \"file\"', found '#include {rest}'"),
                        )
                    })?;
                if depth + 1 >= MAX_INCLUDE_DEPTH {
                    return Err(self.files.diag(
                        pos,
                        format!(
                            "'#include \"{file}\"' nests too deeply (is there an include cycle?)"
                        ),
                    ));
                }
                let parent = path.parent().unwrap_or(Path::new(""));
                let inc = parent.join(file);
                let parent_display = self
                    .files
                    .files
                    .get(pos.file as usize)
                    .map(|f| f.display.clone())
                    .unwrap_or_default();
                let display = match Path::new(&parent_display).parent() {
                    Some(p) if !p.as_os_str().is_empty() => p.join(file).display().to_string(),
                    _ => file.to_owned(),
                };
                self.file(&inc, display, Some(pos), depth + 1)?;
            }
            // `# 12 "file"` line markers, `#pragma`, `#ident`, `#line`, `#error`-free null
            // directive: nothing to do for Rust output.
            "" | "pragma" | "ident" | "line" => {}
            _ if name.starts_with(|c: char| c.is_ascii_digit()) => {}
            "error" => {
                return Err(self.files.diag(pos, format!("#error {rest}")));
            }
            "warning" => {}
            _ => {
                return Err(self.files.diag(
                    pos,
                    format!("unknown preprocessor directive '#{name}'; expected include, define, undef, if, ifdef, ifndef, elif, else, endif or pragma"),
                ));
            }
        }
        Ok(())
    }

    /// Evaluates a `#if` expression.
    fn eval(&self, text: &str, pos: Pos, what: &str) -> Result<i64> {
        let toks =
            expr_tokens(text).map_err(|m| self.files.diag(pos, format!("in {what}: {m}")))?;
        let toks = self
            .expand_expr(toks, &mut HashSet::new(), 0)
            .map_err(|m| self.files.diag(pos, format!("in {what}: {m}")))?;
        if toks.is_empty() {
            return Err(self
                .files
                .diag(pos, format!("expected an expression after '{what}'")));
        }
        let mut p = ExprParser { toks: &toks, i: 0 };
        let v = p
            .ternary()
            .map_err(|m| self.files.diag(pos, format!("in {what}: {m}")))?;
        if let Some(t) = toks.get(p.i) {
            return Err(self.files.diag(
                pos,
                format!("in {what}: expected an operator or end of line, found '{t}'"),
            ));
        }
        Ok(v)
    }

    /// Replaces `defined X`, macros and other identifiers (which count as 0).
    fn expand_expr(
        &self,
        toks: Vec<String>,
        hide: &mut HashSet<String>,
        depth: usize,
    ) -> Result<Vec<String>, String> {
        if depth > MAX_EXPANSION_DEPTH {
            return Err("macro expansion too deep".to_owned());
        }
        let mut out = Vec::new();
        let mut i = 0;
        while i < toks.len() {
            let t = &toks[i];
            if t == "defined" {
                let (name, next) = if toks.get(i + 1).map(String::as_str) == Some("(") {
                    match (toks.get(i + 2), toks.get(i + 3).map(String::as_str)) {
                        (Some(n), Some(")")) => (n, i + 4),
                        _ => return Err("expected 'defined(NAME)'".to_owned()),
                    }
                } else {
                    match toks.get(i + 1) {
                        Some(n) => (n, i + 2),
                        None => return Err("expected a name after 'defined'".to_owned()),
                    }
                };
                if single_ident(name).is_none() {
                    return Err(format!(
                        "expected a macro name after 'defined', found '{name}'"
                    ));
                }
                out.push(
                    if self.defines.contains_key(name) {
                        "1"
                    } else {
                        "0"
                    }
                    .to_owned(),
                );
                i = next;
                continue;
            }
            if single_ident(t).is_some() {
                match self.defines.get(t) {
                    Some(v) if !hide.contains(t) => {
                        hide.insert(t.clone());
                        let inner = expr_tokens(v)?;
                        let inner = self.expand_expr(inner, hide, depth + 1)?;
                        hide.remove(t);
                        if inner.is_empty() {
                            out.push("0".to_owned());
                        } else {
                            out.push("(".to_owned());
                            out.extend(inner);
                            out.push(")".to_owned());
                        }
                    }
                    _ => out.push("0".to_owned()),
                }
            } else {
                out.push(t.clone());
            }
            i += 1;
        }
        Ok(out)
    }
}

fn single_ident(s: &str) -> Option<&str> {
    let mut chars = s.chars();
    let first = chars.next()?;
    ((first.is_ascii_alphabetic() || first == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_'))
    .then_some(s)
}

fn expr_tokens(text: &str) -> Result<Vec<String>, String> {
    let b = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c.is_ascii_whitespace() {
            i += 1;
        } else if c.is_ascii_alphanumeric() || c == b'_' {
            let from = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                i += 1;
            }
            out.push(text[from..i].to_owned());
        } else {
            let two = text.get(i..i + 2).unwrap_or("");
            if ["&&", "||", "==", "!=", "<=", ">=", "<<", ">>"].contains(&two) {
                out.push(two.to_owned());
                i += 2;
            } else if b"()!~+-*/%<>?:&|^".contains(&c) {
                out.push(char::from(c).to_string());
                i += 1;
            } else {
                return Err(format!("unexpected character '{}'", char::from(c)));
            }
        }
    }
    Ok(out)
}

struct ExprParser<'a> {
    toks: &'a [String],
    i: usize,
}

impl ExprParser<'_> {
    fn peek(&self) -> Option<&str> {
        self.toks.get(self.i).map(String::as_str)
    }

    fn ternary(&mut self) -> Result<i64, String> {
        let c = self.binary(0)?;
        if self.peek() == Some("?") {
            self.i += 1;
            let a = self.ternary()?;
            if self.peek() != Some(":") {
                return Err("expected ':' in conditional expression".to_owned());
            }
            self.i += 1;
            let b = self.ternary()?;
            return Ok(if c != 0 { a } else { b });
        }
        Ok(c)
    }

    fn binary(&mut self, min: u8) -> Result<i64, String> {
        let mut lhs = self.unary()?;
        while let Some(op) = self.peek() {
            let prec = match op {
                "||" => 1,
                "&&" => 2,
                "|" => 3,
                "^" => 4,
                "&" => 5,
                "==" | "!=" => 6,
                "<" | ">" | "<=" | ">=" => 7,
                "<<" | ">>" => 8,
                "+" | "-" => 9,
                "*" | "/" | "%" => 10,
                _ => break,
            };
            if prec < min {
                break;
            }
            let op = op.to_owned();
            self.i += 1;
            let rhs = self.binary(prec + 1)?;
            lhs = match op.as_str() {
                "||" => i64::from(lhs != 0 || rhs != 0),
                "&&" => i64::from(lhs != 0 && rhs != 0),
                "|" => lhs | rhs,
                "^" => lhs ^ rhs,
                "&" => lhs & rhs,
                "==" => i64::from(lhs == rhs),
                "!=" => i64::from(lhs != rhs),
                "<" => i64::from(lhs < rhs),
                ">" => i64::from(lhs > rhs),
                "<=" => i64::from(lhs <= rhs),
                ">=" => i64::from(lhs >= rhs),
                "<<" => lhs.wrapping_shl(u32::try_from(rhs & 63).unwrap_or(0)),
                ">>" => lhs.wrapping_shr(u32::try_from(rhs & 63).unwrap_or(0)),
                "+" => lhs.wrapping_add(rhs),
                "-" => lhs.wrapping_sub(rhs),
                "*" => lhs.wrapping_mul(rhs),
                "/" | "%" if rhs == 0 => return Err("division by zero".to_owned()),
                "/" => lhs.wrapping_div(rhs),
                _ => lhs.wrapping_rem(rhs),
            };
        }
        Ok(lhs)
    }

    fn unary(&mut self) -> Result<i64, String> {
        let toks = self.toks;
        let Some(t) = toks.get(self.i).map(String::as_str) else {
            return Err("expected a value, found end of line".to_owned());
        };
        self.i += 1;
        match t {
            "!" => Ok(i64::from(self.unary()? == 0)),
            "-" => Ok(self.unary()?.wrapping_neg()),
            "+" => self.unary(),
            "~" => Ok(!self.unary()?),
            "(" => {
                let v = self.ternary()?;
                if self.peek() != Some(")") {
                    return Err("expected ')'".to_owned());
                }
                self.i += 1;
                Ok(v)
            }
            t if t.starts_with(|c: char| c.is_ascii_digit()) => {
                crate::lex::parse_number(t).map(|(v, _)| v.cast_signed())
            }
            t => Err(format!("expected a value, found '{t}'")),
        }
    }
}

/// Evaluates an integer expression whose identifiers must all be in `known`.
pub(crate) fn eval_simple(text: &str, known: &HashMap<String, i64>) -> Option<i64> {
    let toks = expr_tokens(text).ok()?;
    if toks.is_empty() {
        return None;
    }
    let mut subst = Vec::with_capacity(toks.len());
    for t in toks {
        if single_ident(&t).is_some() {
            subst.push(known.get(&t)?.to_string());
        } else {
            subst.push(t);
        }
    }
    let mut p = ExprParser { toks: &subst, i: 0 };
    let v = p.ternary().ok()?;
    (p.i == subst.len()).then_some(v)
}
