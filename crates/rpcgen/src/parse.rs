//! The recursive-descent parser for RPCL (RFC 5531 section 12, RFC 4506 section 6, rpcgen
//! extensions).

use crate::ast::{
    Arm, BaseType, Decl, Def, Member, Proc, Program, Shape, Value, ValueKind, Version,
};
use crate::error::{Files, Pos, Result};
use crate::lex::{Tok, Token};

/// Keywords that cannot name anything.
const KEYWORDS: &[&str] = &[
    "bool",
    "case",
    "const",
    "default",
    "double",
    "quadruple",
    "enum",
    "float",
    "hyper",
    "int",
    "opaque",
    "string",
    "struct",
    "switch",
    "typedef",
    "union",
    "unsigned",
    "void",
    "program",
    "version",
];

/// A type specifier before its inline definitions get names.
enum Spec {
    Base(BaseType),
    /// An inline `struct {…}`, `enum {…}` or `union switch …` whose name is synthesised from
    /// the declaration (unless it had its own tag).
    Inline(Box<Def>, bool),
}

pub(crate) struct Parser<'a> {
    toks: &'a [Token],
    i: usize,
    files: &'a Files,
    defs: Vec<Def>,
    /// Names of the enclosing definitions and fields, for synthesised names.
    ctx: Vec<String>,
    /// Inside definitions imported through `%#include`: programs are skipped.
    importing: usize,
}

/// Parses a whole specification.
pub(crate) fn parse(toks: &[Token], files: &Files) -> Result<Vec<Def>> {
    let mut p = Parser {
        toks,
        i: 0,
        files,
        defs: Vec::new(),
        ctx: Vec::new(),
        importing: 0,
    };
    while !p.at_eof() {
        p.definition()?;
    }
    let mut defs = p.defs;
    // rpcgen's built-in types from <rpc/xdr.h> and <rpc/auth.h>, when used but not defined:
    // `netobj` is `opaque<MAX_NETOBJ_SZ>` (1024), `des_block` is 8 opaque bytes.
    builtin(&mut defs, toks, "netobj", |v| Shape::Var(Some(v)), 1024);
    builtin(&mut defs, toks, "des_block", Shape::Fixed, 8);
    Ok(defs)
}

impl Parser<'_> {
    fn peek(&self) -> &Token {
        let last = self.toks.len().saturating_sub(1);
        &self.toks[self.i.min(last)]
    }

    fn at_eof(&self) -> bool {
        matches!(self.peek().tok, Tok::Eof)
    }

    fn bump(&mut self) -> Token {
        let t = self.peek().clone();
        if !matches!(t.tok, Tok::Eof) {
            self.i += 1;
        }
        t
    }

    fn err<T>(&self, pos: Pos, msg: impl Into<String>) -> Result<T> {
        Err(self.files.diag(pos, msg))
    }

    fn unexpected<T>(&self, what: &str) -> Result<T> {
        let t = self.peek();
        self.err(t.pos, format!("expected {what}, found {}", t.tok))
    }

    fn is_punct(&self, c: char) -> bool {
        self.peek().tok == Tok::Punct(c)
    }

    fn is_kw(&self, kw: &str) -> bool {
        matches!(&self.peek().tok, Tok::Ident(s) if s == kw)
    }

    fn eat_punct(&mut self, c: char) -> bool {
        if self.is_punct(c) {
            self.i += 1;
            true
        } else {
            false
        }
    }

    fn eat_kw(&mut self, kw: &str) -> bool {
        if self.is_kw(kw) {
            self.i += 1;
            true
        } else {
            false
        }
    }

    fn expect_punct(&mut self, c: char, context: &str) -> Result<Pos> {
        if self.is_punct(c) {
            Ok(self.bump().pos)
        } else {
            self.unexpected(&format!("'{c}' {context}"))
        }
    }

    fn ident(&mut self, what: &str) -> Result<(String, Pos)> {
        match &self.peek().tok {
            Tok::Ident(s) if KEYWORDS.contains(&s.as_str()) => {
                let t = self.peek();
                self.err(t.pos, format!("expected {what}, found keyword '{s}'"))
            }
            Tok::Ident(s) => {
                let s = s.clone();
                let pos = self.bump().pos;
                Ok((s, pos))
            }
            _ => self.unexpected(what),
        }
    }

    /// `constant`: a literal (optionally negative) or an identifier.
    fn value(&mut self, what: &str) -> Result<Value> {
        let pos = self.peek().pos;
        let neg = self.eat_punct('-');
        match self.peek().tok.clone() {
            Tok::Num { value, hex } => {
                self.bump();
                let v = i128::from(value);
                Ok(Value {
                    kind: ValueKind::Lit {
                        value: if neg { -v } else { v },
                        hex,
                    },
                    pos,
                })
            }
            Tok::Ident(s) if !neg && !KEYWORDS.contains(&s.as_str()) => {
                self.bump();
                Ok(Value {
                    kind: ValueKind::Name(s),
                    pos,
                })
            }
            _ => self.unexpected(what),
        }
    }

    fn definition(&mut self) -> Result<()> {
        let t = self.peek().clone();
        match t.tok {
            Tok::ImportStart => {
                self.bump();
                self.importing += 1;
                return Ok(());
            }
            Tok::ImportEnd => {
                self.bump();
                self.importing = self.importing.saturating_sub(1);
                return Ok(());
            }
            _ => {}
        }
        let Tok::Ident(kw) = &t.tok else {
            return self.unexpected(
                "a definition ('const', 'enum', 'struct', 'union', 'typedef' or 'program')",
            );
        };
        match kw.as_str() {
            "const" => {
                self.bump();
                let (name, pos) = self.ident("a constant name after 'const'")?;
                self.expect_punct('=', &format!("after constant name '{name}'"))?;
                if let Tok::Str(text) = self.peek().tok.clone() {
                    self.bump();
                    self.expect_punct(';', &format!("after the value of constant '{name}'"))?;
                    self.defs.push(Def::StrConst { name, pos, text });
                    return Ok(());
                }
                let value = self.value(&format!(
                    "a number or constant name as the value of '{name}'"
                ))?;
                self.expect_punct(';', &format!("after the value of constant '{name}'"))?;
                self.defs.push(Def::Const { name, pos, value });
            }
            "enum" | "struct" | "union" => {
                self.bump();
                let (name, pos) = self.ident(&format!("a type name after '{kw}'"))?;
                self.ctx.push(name.clone());
                let def = self.type_body(kw, name.clone(), pos)?;
                self.ctx.pop();
                self.expect_punct(';', &format!("after the definition of {kw} '{name}'"))?;
                self.defs.push(def);
            }
            "typedef" => {
                self.bump();
                let decl = self.declaration("typedef", true)?;
                if decl.ty == BaseType::Void {
                    return self.err(decl.ty_pos, "a typedef cannot be 'void'");
                }
                self.expect_punct(
                    ';',
                    &format!("after the declaration of typedef '{}'", decl.name),
                )?;
                if decl.shape == Shape::Plain && decl.ty == BaseType::Named(decl.name.clone()) {
                    // `typedef struct { ... } name;`: the inline type already took the name.
                    return Ok(());
                }
                self.defs.push(Def::Typedef {
                    name: decl.name.clone(),
                    pos: decl.pos,
                    decl,
                });
            }
            "program" => {
                self.bump();
                let p = self.program()?;
                if self.importing == 0 {
                    self.defs.push(Def::Program(p));
                }
            }
            "quadruple" => {
                return self.err(
                    t.pos,
                    "'quadruple' (128-bit floating point) is not supported",
                );
            }
            _ => {
                return self.unexpected(
                    "a definition ('const', 'enum', 'struct', 'union', 'typedef' or 'program')",
                );
            }
        }
        Ok(())
    }

    /// The body of an enum, struct or union, after its name.
    fn type_body(&mut self, kw: &str, name: String, pos: Pos) -> Result<Def> {
        match kw {
            "enum" => {
                self.expect_punct('{', &format!("to open the body of enum '{name}'"))?;
                let mut members = Vec::new();
                loop {
                    if self.is_punct('}') && !members.is_empty() {
                        break;
                    }
                    let (mname, mpos) =
                        self.ident(&format!("an enumerator name in enum '{name}'"))?;
                    let value = if self.eat_punct('=') {
                        Some(self.value(&format!(
                            "a number or constant name as the value of '{mname}'"
                        ))?)
                    } else {
                        None
                    };
                    members.push(Member {
                        name: mname.clone(),
                        pos: mpos,
                        value,
                    });
                    if !self.eat_punct(',') {
                        if self.is_punct('}') {
                            break;
                        }
                        return self.unexpected(&format!(
                            "',' or '}}' after enumerator '{mname}' in enum '{name}'"
                        ));
                    }
                }
                self.expect_punct('}', &format!("to close enum '{name}'"))?;
                Ok(Def::Enum { name, pos, members })
            }
            "struct" => {
                self.expect_punct('{', &format!("to open the body of struct '{name}'"))?;
                let mut fields = Vec::new();
                while !self.is_punct('}') || fields.is_empty() {
                    let d = self.declaration(&format!("field of struct '{name}'"), false)?;
                    if d.ty == BaseType::Void {
                        return self.err(
                            d.ty_pos,
                            format!("struct '{name}' cannot have a 'void' field"),
                        );
                    }
                    self.expect_punct(';', &format!("after declaration of field '{}'", d.name))?;
                    fields.push(d);
                }
                self.bump();
                Ok(Def::Struct { name, pos, fields })
            }
            _ => {
                if !self.eat_kw("switch") {
                    return self.unexpected(&format!("'switch' after 'union {name}'"));
                }
                self.expect_punct('(', &format!("after 'switch' in union '{name}'"))?;
                let disc = self.declaration(&format!("discriminant of union '{name}'"), false)?;
                self.expect_punct(')', &format!("after the discriminant of union '{name}'"))?;
                self.expect_punct('{', &format!("to open the body of union '{name}'"))?;
                let mut arms = Vec::new();
                let mut default = None;
                loop {
                    if self.is_kw("case") {
                        let mut labels = Vec::new();
                        while self.eat_kw("case") {
                            labels.push(self.value(&format!(
                                "a case label (number or constant) in union '{name}'"
                            ))?);
                            self.expect_punct(':', "after case label")?;
                        }
                        let decl = self.declaration(&format!("arm of union '{name}'"), false)?;
                        self.expect_punct(
                            ';',
                            &format!("after declaration of union arm '{}'", arm_name(&decl)),
                        )?;
                        arms.push(Arm { labels, decl });
                    } else if self.is_kw("default") {
                        let dpos = self.bump().pos;
                        if default.is_some() {
                            return self.err(
                                dpos,
                                format!("union '{name}' has more than one 'default' arm"),
                            );
                        }
                        self.expect_punct(':', "after 'default'")?;
                        let decl =
                            self.declaration(&format!("default arm of union '{name}'"), false)?;
                        self.expect_punct(
                            ';',
                            &format!("after declaration of union arm '{}'", arm_name(&decl)),
                        )?;
                        default = Some(decl);
                    } else if self.is_punct('}') && (!arms.is_empty() || default.is_some()) {
                        self.bump();
                        break;
                    } else {
                        return self
                            .unexpected(&format!("'case', 'default' or '}}' in union '{name}'"));
                    }
                }
                Ok(Def::Union {
                    name,
                    pos,
                    disc,
                    arms,
                    default,
                })
            }
        }
    }

    /// A type specifier (after which a declarator follows).
    fn type_spec(&mut self, context: &str) -> Result<(Spec, Pos)> {
        let t = self.peek().clone();
        let Tok::Ident(word) = &t.tok else {
            return self.unexpected(&format!("a type in {context}"));
        };
        let base = |b| Ok((Spec::Base(b), t.pos));
        self.bump();
        match word.as_str() {
            "int" | "long" | "int32_t" | "bool_t" | "enum_t" => base(BaseType::Int),
            "unsigned" => {
                if self.eat_kw("int") || self.eat_kw("long") {
                    base(BaseType::UInt)
                } else if self.eat_kw("hyper") {
                    base(BaseType::UHyper)
                } else if self.eat_kw("char") {
                    base(BaseType::UChar)
                } else if self.eat_kw("short") {
                    base(BaseType::UShort)
                } else {
                    base(BaseType::UInt)
                }
            }
            "u_int" | "u_long" | "uint32_t" | "u_int32_t" => base(BaseType::UInt),
            "hyper" | "int64_t" | "quad_t" | "longlong_t" => base(BaseType::Hyper),
            "uint64_t" | "u_int64_t" | "u_quad_t" | "u_longlong_t" => base(BaseType::UHyper),
            "float" => base(BaseType::Float),
            "double" => base(BaseType::Double),
            "quadruple" => self.err(
                t.pos,
                "'quadruple' (128-bit floating point) is not supported",
            ),
            "bool" => base(BaseType::Bool),
            "char" | "int8_t" => base(BaseType::Char),
            "u_char" | "uint8_t" | "u_int8_t" => base(BaseType::UChar),
            "short" | "int16_t" => base(BaseType::Short),
            "u_short" | "uint16_t" | "u_int16_t" => base(BaseType::UShort),
            "opaque" => base(BaseType::Opaque),
            "string" => base(BaseType::String),
            "void" => base(BaseType::Void),
            "struct" | "enum" | "union" => {
                let kw = word.clone();
                let tag = match &self.peek().tok {
                    Tok::Ident(s) if !KEYWORDS.contains(&s.as_str()) => {
                        let s = s.clone();
                        let p = self.bump().pos;
                        Some((s, p))
                    }
                    _ => None,
                };
                let opens_body = if kw == "union" {
                    self.is_kw("switch")
                } else {
                    self.is_punct('{')
                };
                match (tag, opens_body) {
                    (Some((name, _)), false) => base(BaseType::Named(name)),
                    (tag, true) => {
                        let named = tag.is_some();
                        let (name, pos) = tag.unwrap_or_else(|| (String::new(), t.pos));
                        let def = self.type_body(&kw, name, pos)?;
                        Ok((Spec::Inline(Box::new(def), named), t.pos))
                    }
                    (None, false) => self.unexpected(&format!(
                        "a type name or '{}' after '{kw}' in {context}",
                        if kw == "union" { "switch" } else { "{" }
                    )),
                }
            }
            w if KEYWORDS.contains(&w) => self.err(
                t.pos,
                format!("expected a type in {context}, found keyword '{w}'"),
            ),
            _ => base(BaseType::Named(word.clone())),
        }
    }

    /// Turns a type specifier into a base type, naming and emitting any inline definition.
    fn resolve_spec(
        &mut self,
        spec: Spec,
        decl_name: &str,
        typedef: bool,
        plain: bool,
    ) -> BaseType {
        match spec {
            Spec::Base(b) => b,
            Spec::Inline(mut def, named) => {
                let name = if named {
                    def.name().to_owned()
                } else if typedef && plain {
                    decl_name.to_owned()
                } else if self.ctx.is_empty() {
                    format!("{decl_name}_elem")
                } else {
                    let mut parts = self.ctx.clone();
                    parts.push(decl_name.to_owned());
                    parts.retain(|p| !p.is_empty());
                    parts.join("_")
                };
                def.set_name(name.clone());
                self.defs.push(*def);
                BaseType::Named(name)
            }
        }
    }

    /// A declaration (field, arm, typedef or discriminant).
    fn declaration(&mut self, context: &str, typedef: bool) -> Result<Decl> {
        // The name is needed to name inline types, and comes after them; parse the body with
        // a placeholder context entry that is fixed up below.
        let (spec, ty_pos) = self.type_spec(context)?;
        if let Spec::Base(BaseType::Void) = spec {
            return Ok(Decl {
                name: String::new(),
                pos: ty_pos,
                ty: BaseType::Void,
                ty_pos,
                shape: Shape::Plain,
            });
        }
        let optional = self.eat_punct('*');
        let (name, pos) = self.ident(&format!("a name in {context}"))?;
        let shape = if optional {
            Shape::Optional
        } else if self.eat_punct('[') {
            let v = self.value(&format!("an array size (number or constant) for '{name}'"))?;
            self.expect_punct(']', &format!("after the array size of '{name}'"))?;
            Shape::Fixed(v)
        } else if self.eat_punct('<') {
            let v = if self.is_punct('>') {
                None
            } else {
                Some(self.value(&format!(
                    "a maximum size (number or constant) or '>' for '{name}'"
                ))?)
            };
            self.expect_punct('>', &format!("after the maximum size of '{name}'"))?;
            Shape::Var(v)
        } else {
            Shape::Plain
        };
        let plain = shape == Shape::Plain;
        let ty = self.resolve_spec(spec, &name, typedef, plain);
        self.shaped_decl(name, pos, ty, ty_pos, shape, context)
    }

    /// A procedure argument or result: a type, optionally `*` or `<n>`, optionally a name.
    fn proc_type(&mut self, context: &str) -> Result<Decl> {
        let (spec, ty_pos) = self.type_spec(context)?;
        let ty = match spec {
            Spec::Base(b) => b,
            Spec::Inline(..) => {
                return self.err(ty_pos, format!("inline type definitions are not allowed in {context}; define the type separately"));
            }
        };
        let shape = if ty == BaseType::Void {
            Shape::Plain
        } else if self.eat_punct('*') {
            Shape::Optional
        } else if ty == BaseType::String && !self.is_punct('<') {
            // rpcgen allows a bare `string` argument: unbounded.
            Shape::Var(None)
        } else if self.eat_punct('<') {
            let v = if self.is_punct('>') {
                None
            } else {
                Some(self.value("a maximum size or '>'")?)
            };
            self.expect_punct('>', "after the maximum size")?;
            Shape::Var(v)
        } else {
            Shape::Plain
        };
        let (name, pos) = match &self.peek().tok {
            Tok::Ident(s) if ty != BaseType::Void && !KEYWORDS.contains(&s.as_str()) => {
                let s = s.clone();
                (s, self.bump().pos)
            }
            _ => (String::new(), ty_pos),
        };
        self.shaped_decl(name, pos, ty, ty_pos, shape, context)
    }

    /// Declaration `name` (at `pos`; `context` when unnamed) of `ty` (at `ty_pos`), once
    /// `shape` is checked to suit `ty`.
    fn shaped_decl(
        &self,
        name: String,
        pos: Pos,
        ty: BaseType,
        ty_pos: Pos,
        shape: Shape,
        context: &str,
    ) -> Result<Decl> {
        let what = if name.is_empty() { context } else { &name };
        check_shape(self.files, &ty, ty_pos, &shape, what)?;
        Ok(Decl {
            name,
            pos,
            ty,
            ty_pos,
            shape,
        })
    }

    fn program(&mut self) -> Result<Program> {
        let (name, pos) = self.ident("a program name after 'program'")?;
        self.expect_punct('{', &format!("to open program '{name}'"))?;
        let mut versions = Vec::new();
        while !self.is_punct('}') || versions.is_empty() {
            if !self.eat_kw("version") {
                return self.unexpected(&format!("'version' in program '{name}'"));
            }
            let (vname, vpos) = self.ident("a version name after 'version'")?;
            self.expect_punct('{', &format!("to open version '{vname}'"))?;
            let mut procs = Vec::new();
            while !self.is_punct('}') || procs.is_empty() {
                procs.push(self.procedure(&vname)?);
            }
            self.bump();
            let number = self.numbered("the body of", "version", &vname)?;
            versions.push(Version {
                name: vname,
                pos: vpos,
                number,
                procs,
            });
        }
        self.bump();
        let number = self.numbered("the body of", "program", &name)?;
        Ok(Program {
            name,
            pos,
            number,
            versions,
        })
    }

    /// `= NUMBER ;` after `what` (`"the body of"`) of `kind` (`"program"`) `name`.
    fn numbered(&mut self, what: &str, kind: &str, name: &str) -> Result<Value> {
        self.expect_punct('=', &format!("after {what} {kind} '{name}'"))?;
        let number = self.value(&format!("a {kind} number for '{name}'"))?;
        self.expect_punct(';', &format!("after the number of {kind} '{name}'"))?;
        Ok(number)
    }

    fn procedure(&mut self, version: &str) -> Result<Proc> {
        let oneway = self.peek().oneway;
        let result =
            self.proc_type(&format!("a procedure's result type in version '{version}'"))?;
        // In `type name (`, the "name" parsed with the type is the procedure name.
        let (name, pos) = if result.name.is_empty() {
            self.ident("a procedure name")?
        } else {
            (result.name.clone(), result.pos)
        };
        let result = Decl {
            name: String::new(),
            pos: result.ty_pos,
            ..result
        };
        self.expect_punct('(', &format!("after procedure name '{name}'"))?;
        let mut args = Vec::new();
        loop {
            let a = self.proc_type(&format!("the arguments of procedure '{name}'"))?;
            if a.ty == BaseType::Void {
                if !args.is_empty() || self.is_punct(',') {
                    return self.err(
                        a.ty_pos,
                        format!("'void' must be the only argument of procedure '{name}'"),
                    );
                }
            } else {
                args.push(a);
            }
            if !self.eat_punct(',') {
                break;
            }
        }
        self.expect_punct(')', &format!("after the arguments of procedure '{name}'"))?;
        let number = self.numbered("the arguments of", "procedure", &name)?;
        Ok(Proc {
            name,
            pos,
            number,
            args,
            result,
            oneway,
        })
    }
}

fn builtin(
    defs: &mut Vec<Def>,
    toks: &[Token],
    name: &str,
    shape: impl Fn(Value) -> Shape,
    size: i128,
) {
    if !defs.iter().any(|d| d.name() == name)
        && let Some(t) = toks
            .iter()
            .find(|t| matches!(&t.tok, Tok::Ident(s) if s == name))
    {
        let pos = t.pos;
        let value = Value {
            kind: ValueKind::Lit {
                value: size,
                hex: false,
            },
            pos,
        };
        defs.insert(
            0,
            Def::Typedef {
                name: name.into(),
                pos,
                decl: Decl {
                    name: name.into(),
                    pos,
                    ty: BaseType::Opaque,
                    ty_pos: pos,
                    shape: shape(value),
                },
            },
        );
    }
}

fn arm_name(d: &Decl) -> String {
    if d.name.is_empty() {
        "void".to_owned()
    } else {
        d.name.clone()
    }
}

/// Checks that `opaque`/`string` appear only with the shapes they allow.
fn check_shape(files: &Files, ty: &BaseType, pos: Pos, shape: &Shape, name: &str) -> Result<()> {
    match (ty, shape) {
        (BaseType::String, Shape::Var(_)) | (BaseType::Opaque, Shape::Var(_) | Shape::Fixed(_)) => Ok(()),
        (BaseType::String, _) => Err(files.diag(
            pos,
            format!("'string' needs a maximum size: expected 'string {name}<N>' or 'string {name}<>'"),
        )),
        (BaseType::Opaque, _) => Err(files.diag(
            pos,
            format!("'opaque' needs a size: expected 'opaque {name}[N]', 'opaque {name}<N>' or 'opaque {name}<>'"),
        )),
        _ => Ok(()),
    }
}
