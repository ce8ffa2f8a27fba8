//! Semantic checks and Rust code generation.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;

use crate::ast::{BaseType, Decl, Def, Program, Shape, Value, ValueKind};
use crate::error::{Error, Files, Pos, Result};
use crate::names::{camel, snake, type_name, upper};

/// The lints generated code may trip (unused items, undocumented fields, C-style names that
/// could not be converted, clippy's style lints). Put `#[allow(..)]` with these on the module
/// that `include!`s generated code; `remora rpcgen` puts `#![allow(..)]` at the top of the
/// crate it writes.
pub const ALLOWED_LINTS: &str =
    "dead_code, missing_docs, unreachable_pub, non_camel_case_types, clippy::all";

const X: &str = "::remora_xdr";
const RPC: &str = "::remora_oncrpc";

/// What a union switches on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Disc {
    Int,
    UInt,
    Bool,
    /// The C name of the enum.
    Enum(String),
}

/// Where the value being encoded lives.
struct Place {
    /// An expression of type `T` (for `Copy` primitives).
    val: String,
    /// An expression of type `&T`.
    rf: String,
    /// An expression usable as a method receiver.
    recv: String,
}

impl Place {
    fn field(expr: &str) -> Self {
        Self {
            val: expr.to_owned(),
            rf: format!("&{expr}"),
            recv: expr.to_owned(),
        }
    }

    fn reference(var: &str) -> Self {
        Self {
            val: format!("*{var}"),
            rf: var.to_owned(),
            recv: var.to_owned(),
        }
    }
}

/// An expression and whether it yields `xdr::Result<()>` (else `()`).
struct EncExpr {
    code: String,
    fallible: bool,
}

impl EncExpr {
    fn stmt(&self) -> String {
        if self.fallible {
            format!("{}?;", self.code)
        } else {
            format!("{};", self.code)
        }
    }

    /// As the body of a closure or function returning `xdr::Result<()>`.
    fn result(&self) -> String {
        if self.fallible {
            self.code.clone()
        } else {
            format!("{{ {}; Ok(()) }}", self.code)
        }
    }
}

pub(crate) struct Gen<'a> {
    files: &'a Files,
    pub(crate) defs: &'a [Def],
    /// Every named definition (types, consts, enum members, programs) by C name.
    symbols: HashMap<String, Symbol<'a>>,
    values: RefCell<HashMap<String, i128>>,
    /// Rust names already used: (namespace, name) → (C name, position).
    claimed: HashMap<(String, String), (String, Pos)>,
    /// Constants already emitted for program/version/procedure numbers: name → value.
    number_consts: HashMap<String, (u32, String, Pos)>,
    default_cache: RefCell<HashMap<String, bool>>,
    out: String,
}

#[derive(Clone, Copy)]
enum Symbol<'a> {
    Type(&'a Def),
    Const(&'a Value),
    /// An enum member: the enum, and the member's index.
    Member(&'a Def, usize),
    Program(Pos),
}

impl<'a> Gen<'a> {
    pub(crate) fn new(files: &'a Files, defs: &'a [Def]) -> Result<Self> {
        let mut g = Gen {
            files,
            defs,
            symbols: HashMap::new(),
            values: RefCell::new(HashMap::new()),
            claimed: HashMap::new(),
            number_consts: HashMap::new(),
            default_cache: RefCell::new(HashMap::new()),
            out: String::new(),
        };
        for def in defs {
            match def {
                Def::Const { name, pos, value } => {
                    g.add_symbol(name, *pos, Symbol::Const(value))?
                }
                Def::Enum { members, .. } => {
                    g.add_symbol(def.name(), def.pos(), Symbol::Type(def))?;
                    for (i, m) in members.iter().enumerate() {
                        g.add_symbol(&m.name, m.pos, Symbol::Member(def, i))?;
                    }
                }
                Def::Program(p) => g.add_symbol(&p.name, p.pos, Symbol::Program(p.pos))?,
                Def::StrConst { name, pos, .. } => {
                    g.add_symbol(name, *pos, Symbol::Program(*pos))?
                }
                _ => g.add_symbol(def.name(), def.pos(), Symbol::Type(def))?,
            }
        }
        Ok(g)
    }

    fn add_symbol(&mut self, name: &str, pos: Pos, sym: Symbol<'a>) -> Result<()> {
        if let Some(prev) = self.symbols.get(name) {
            let prev_pos = match prev {
                Symbol::Type(d) => d.pos(),
                Symbol::Const(v) => self.const_pos(name).unwrap_or(v.pos),
                Symbol::Member(d, i) => match d {
                    Def::Enum { members, .. } => members[*i].pos,
                    _ => d.pos(),
                },
                Symbol::Program(p) => *p,
            };
            return Err(self.files.diag(
                pos,
                format!(
                    "duplicate definition of '{name}' (first defined at {})",
                    self.files.describe(prev_pos)
                ),
            ));
        }
        self.symbols.insert(name.to_owned(), sym);
        Ok(())
    }

    fn const_pos(&self, name: &str) -> Option<Pos> {
        self.defs.iter().find_map(|d| match d {
            Def::Const { name: n, pos, .. } if n == name => Some(*pos),
            _ => None,
        })
    }

    fn err<T>(&self, pos: Pos, msg: impl Into<String>) -> Result<T> {
        Err(self.files.diag(pos, msg))
    }

    // ----- constants -----

    /// The value of a constant expression.
    pub(crate) fn eval(&self, v: &Value) -> Result<i128> {
        self.eval_depth(v, 0)
    }

    fn eval_depth(&self, v: &Value, depth: usize) -> Result<i128> {
        let name = match &v.kind {
            ValueKind::Lit { value, .. } => return Ok(*value),
            ValueKind::Name(n) => n,
        };
        if let Some(x) = self.values.borrow().get(name) {
            return Ok(*x);
        }
        if depth > 200 {
            return self.err(
                v.pos,
                format!("constant '{name}' is defined in terms of itself"),
            );
        }
        let value = match self.symbols.get(name) {
            Some(Symbol::Const(inner)) => self.eval_depth(inner, depth + 1)?,
            Some(Symbol::Member(Def::Enum { members, .. }, i)) => {
                // Omitted values count up from the previous member (rpcgen), from 0.
                let mut back = 0i128;
                let mut j = *i;
                loop {
                    match &members[j].value {
                        Some(val) => break self.eval_depth(val, depth + 1)? + back,
                        None if j == 0 => break back,
                        None => {
                            back += 1;
                            j -= 1;
                        }
                    }
                }
            }
            Some(Symbol::Type(_)) => {
                return self.err(
                    v.pos,
                    format!("expected a constant, but '{name}' is a type"),
                );
            }
            Some(Symbol::Program(_)) => {
                return self.err(
                    v.pos,
                    format!("expected a number, but '{name}' is a program or string constant"),
                );
            }
            Some(Symbol::Member(..)) => 0,
            None if name == "TRUE" => 1,
            None if name == "FALSE" => 0,
            // From the C RPC headers that rpcgen output includes.
            None if name == "MAXNETNAMELEN" => 255,
            None if name == "MAX_NETOBJ_SZ" => 1024,
            None => {
                return self.err(
                    v.pos,
                    format!(
                        "undefined constant '{name}': expected a number, a 'const' or an enum value"
                    ),
                );
            }
        };
        self.values.borrow_mut().insert(name.clone(), value);
        Ok(value)
    }

    /// A size or bound: 0 ..= u32::MAX.
    fn bound(&self, v: &Value, what: &str) -> Result<u32> {
        let n = self.eval(v)?;
        if n < 0 {
            return self.err(v.pos, format!("{what} must not be negative, found {n}"));
        }
        u32::try_from(n).or_else(|_| {
            self.err(
                v.pos,
                format!("{what} must fit in an unsigned 32-bit integer, found {n}"),
            )
        })
    }

    /// The Rust text of a variable-length bound: the constant's name when it is a `const`.
    fn bound_text(&self, v: &Option<Value>, what: &str) -> Result<String> {
        match v {
            None => Ok(format!("{X}::UNBOUNDED")),
            Some(v) => {
                let n = self.bound(v, what)?;
                if n == u32::MAX {
                    return Ok(format!("{X}::UNBOUNDED"));
                }
                match &v.kind {
                    ValueKind::Name(name)
                        if matches!(self.symbols.get(name), Some(Symbol::Const(_))) =>
                    {
                        Ok(upper(name))
                    }
                    _ => Ok(n.to_string()),
                }
            }
        }
    }

    // ----- names -----

    fn claim(&mut self, ns: &str, rust: &str, c_name: &str, pos: Pos) -> Result<()> {
        let key = (ns.to_owned(), rust.to_owned());
        if let Some((other, opos)) = self.claimed.get(&key) {
            let msg = if other == c_name {
                format!(
                    "'{c_name}' is defined twice (first at {})",
                    self.files.describe(*opos)
                )
            } else {
                format!(
                    "'{c_name}' becomes the Rust name `{rust}`, which is already used for '{other}' (at {}); rename one of them",
                    self.files.describe(*opos)
                )
            };
            return self.err(pos, msg);
        }
        self.claimed.insert(key, (c_name.to_owned(), pos));
        Ok(())
    }

    // ----- types -----

    fn lookup_type(&self, name: &str, pos: Pos) -> Result<&'a Def> {
        match self.symbols.get(name) {
            Some(Symbol::Type(d)) => Ok(d),
            Some(_) => self.err(pos, format!("expected a type, but '{name}' is a constant")),
            None => self.err(pos, format!("undefined type '{name}'")),
        }
    }

    fn base_rust(&self, ty: &BaseType, pos: Pos) -> Result<String> {
        Ok(match ty {
            BaseType::Int => "i32".into(),
            BaseType::UInt => "u32".into(),
            BaseType::Hyper => "i64".into(),
            BaseType::UHyper => "u64".into(),
            BaseType::Float => "f32".into(),
            BaseType::Double => "f64".into(),
            BaseType::Bool => "bool".into(),
            BaseType::Char => "i8".into(),
            BaseType::UChar => "u8".into(),
            BaseType::Short => "i16".into(),
            BaseType::UShort => "u16".into(),
            BaseType::Opaque => "u8".into(),
            BaseType::String => "String".into(),
            BaseType::Void => "()".into(),
            BaseType::Named(n) => {
                self.lookup_type(n, pos)?;
                type_name(n)
            }
        })
    }

    pub(crate) fn decl_rust(&self, d: &Decl) -> Result<String> {
        let base = self.base_rust(&d.ty, d.ty_pos)?;
        Ok(match (&d.shape, &d.ty) {
            (Shape::Plain, _) => base,
            (Shape::Fixed(n), _) => format!("[{base}; {}]", self.bound(n, &self.size_what(d))?),
            (Shape::Var(_), BaseType::Opaque) => format!("{X}::Bytes"),
            (Shape::Var(_), BaseType::String) => "String".into(),
            (Shape::Var(_), _) => format!("Vec<{base}>"),
            (Shape::Optional, _) => format!("Option<Box<{base}>>"),
        })
    }

    /// The Rust type of a union arm's payload; `None` for `void`.
    pub(crate) fn payload_rust(&self, d: &Decl) -> Result<Option<String>> {
        if d.ty == BaseType::Void {
            Ok(None)
        } else {
            self.decl_rust(d).map(Some)
        }
    }

    fn size_what(&self, d: &Decl) -> String {
        if d.name.is_empty() {
            "the size".to_owned()
        } else {
            format!("the size of '{}'", d.name)
        }
    }

    fn is_typedef(&self, name: &str) -> bool {
        matches!(
            self.symbols.get(name),
            Some(Symbol::Type(Def::Typedef { .. }))
        )
    }

    /// Encodes one element of type `ty` (no shape) at `p`.
    fn enc_base(&self, ty: &BaseType, p: &Place) -> EncExpr {
        let inf = |code: String| EncExpr {
            code,
            fallible: false,
        };
        match ty {
            BaseType::Int => inf(format!("enc.put_i32({})", p.val)),
            BaseType::UInt => inf(format!("enc.put_u32({})", p.val)),
            BaseType::Hyper => inf(format!("enc.put_i64({})", p.val)),
            BaseType::UHyper => inf(format!("enc.put_u64({})", p.val)),
            BaseType::Float => inf(format!("enc.put_f32({})", p.val)),
            BaseType::Double => inf(format!("enc.put_f64({})", p.val)),
            BaseType::Bool => inf(format!("enc.put_bool({})", p.val)),
            BaseType::Char | BaseType::Short => inf(format!("enc.put_i32(i32::from({}))", p.val)),
            BaseType::UChar | BaseType::UShort => inf(format!("enc.put_u32(u32::from({}))", p.val)),
            BaseType::Named(n) if self.is_typedef(n) => EncExpr {
                code: format!("encode_{}({}, enc)", snake_fn(n), p.rf),
                fallible: true,
            },
            BaseType::Named(_) => EncExpr {
                code: format!("{}.encode(enc)", p.recv),
                fallible: true,
            },
            // Handled by the shapes; unreachable for valid declarations.
            BaseType::Opaque | BaseType::String | BaseType::Void => inf("()".to_owned()),
        }
    }

    fn dec_base(&self, ty: &BaseType) -> String {
        match ty {
            BaseType::Int => "dec.get_i32()".into(),
            BaseType::UInt => "dec.get_u32()".into(),
            BaseType::Hyper => "dec.get_i64()".into(),
            BaseType::UHyper => "dec.get_u64()".into(),
            BaseType::Float => "dec.get_f32()".into(),
            BaseType::Double => "dec.get_f64()".into(),
            BaseType::Bool => "dec.get_bool()".into(),
            BaseType::Char => "dec.get_narrow::<i8>(\"char\")".into(),
            BaseType::Short => "dec.get_narrow::<i16>(\"short\")".into(),
            BaseType::UChar => "dec.get_narrow_unsigned::<u8>(\"u_char\")".into(),
            BaseType::UShort => "dec.get_narrow_unsigned::<u16>(\"u_short\")".into(),
            BaseType::Named(n) if self.is_typedef(n) => format!("decode_{}(dec)", snake_fn(n)),
            BaseType::Named(n) => format!("{}::decode(dec)", type_name(n)),
            BaseType::Opaque | BaseType::String | BaseType::Void => "Ok(())".into(),
        }
    }

    /// Encodes a whole declaration at `p`, applying its bound.
    fn enc_decl(&self, d: &Decl, p: &Place) -> Result<EncExpr> {
        let fallible = |code: String| EncExpr {
            code,
            fallible: true,
        };
        Ok(match (&d.shape, &d.ty) {
            (Shape::Plain, ty) => self.enc_base(ty, p),
            (Shape::Fixed(_), BaseType::Opaque) => EncExpr {
                code: format!("enc.put_fixed_opaque({})", p.rf),
                fallible: false,
            },
            (Shape::Fixed(n), ty) => {
                let n = self.bound(n, &self.size_what(d))?;
                let el = self.enc_base(ty, &Place::reference("x")).result();
                fallible(format!("enc.put_fixed_array({}, {n}, |enc, x| {el})", p.rf))
            }
            (Shape::Var(b), ty) => {
                let b = self.bound_text(b, &self.bound_what(d))?;
                fallible(match ty {
                    BaseType::Opaque => format!("enc.put_opaque_bytes({}, {b})", p.rf),
                    BaseType::String => format!("enc.put_string({}, {b})", p.rf),
                    ty => {
                        let el = self.enc_base(ty, &Place::reference("x")).result();
                        format!("enc.put_array({}, {b}, |enc, x| {el})", p.rf)
                    }
                })
            }
            (Shape::Optional, ty) => {
                let el = self.enc_base(ty, &Place::reference("x")).result();
                fallible(format!(
                    "enc.put_option({}.as_deref(), |enc, x| {el})",
                    p.recv
                ))
            }
        })
    }

    fn bound_what(&self, d: &Decl) -> String {
        if d.name.is_empty() {
            "the maximum size".to_owned()
        } else {
            format!("the maximum size of '{}'", d.name)
        }
    }

    /// An expression of type `xdr::Result<T>` decoding a declaration.
    fn dec_decl(&self, d: &Decl) -> Result<String> {
        Ok(match (&d.shape, &d.ty) {
            (Shape::Plain, ty) => self.dec_base(ty),
            (Shape::Fixed(n), ty) => {
                let n = self.bound(n, &self.size_what(d))?;
                match ty {
                    BaseType::Opaque => format!("dec.get_fixed_opaque::<{n}>()"),
                    ty => format!("dec.get_fixed_array::<_, {n}>(|dec| {})", self.dec_base(ty)),
                }
            }
            (Shape::Var(b), ty) => {
                let b = self.bound_text(b, &self.bound_what(d))?;
                match ty {
                    BaseType::Opaque => format!("dec.get_opaque({b})"),
                    BaseType::String => format!("dec.get_string({b})"),
                    ty => format!("dec.get_array({b}, |dec| {})", self.dec_base(ty)),
                }
            }
            (Shape::Optional, ty) => {
                format!("dec.get_option(|dec| {}.map(Box::new))", self.dec_base(ty))
            }
        })
    }

    /// Whether a declaration's Rust type implements `Default`.
    fn decl_default(&self, d: &Decl) -> bool {
        match &d.shape {
            Shape::Var(_) | Shape::Optional => true,
            Shape::Fixed(n) => self.eval(n).is_ok_and(|n| n <= 32) && self.base_default(&d.ty),
            Shape::Plain => self.base_default(&d.ty),
        }
    }

    fn base_default(&self, ty: &BaseType) -> bool {
        let BaseType::Named(n) = ty else { return true };
        if let Some(v) = self.default_cache.borrow().get(n) {
            return *v;
        }
        // Guard against cycles (only possible through indirection, which is Default).
        self.default_cache.borrow_mut().insert(n.clone(), false);
        let v = match self.symbols.get(n) {
            Some(Symbol::Type(Def::Enum { .. })) => true,
            Some(Symbol::Type(Def::Struct { fields, .. })) => {
                fields.iter().all(|f| self.decl_default(f))
            }
            Some(Symbol::Type(Def::Typedef { decl, .. })) => self.decl_default(decl),
            _ => false,
        };
        self.default_cache.borrow_mut().insert(n.clone(), v);
        v
    }

    /// Checks that declarations refer to defined types, with valid bounds.
    fn check_decl(&self, d: &Decl) -> Result<()> {
        self.decl_rust(d)?;
        self.enc_decl(d, &Place::field("x"))?;
        self.dec_decl(d)?;
        Ok(())
    }

    /// Types a definition contains by value (not through `*` or `<>`).
    fn direct_deps(&self, def: &Def) -> Vec<(String, Pos)> {
        let of = |d: &Decl| match (&d.ty, &d.shape) {
            (BaseType::Named(n), Shape::Plain | Shape::Fixed(_)) => Some((n.clone(), d.ty_pos)),
            _ => None,
        };
        match def {
            Def::Struct { fields, .. } => fields.iter().filter_map(of).collect(),
            Def::Union { arms, default, .. } => arms
                .iter()
                .map(|a| &a.decl)
                .chain(default)
                .filter_map(of)
                .collect(),
            Def::Typedef { decl, .. } => of(decl).into_iter().collect(),
            _ => Vec::new(),
        }
    }

    fn check_recursion(&self) -> Result<()> {
        // Depth-first search for a cycle of by-value containment.
        fn visit<'g>(
            g: &Gen<'g>,
            name: &str,
            stack: &mut Vec<String>,
            done: &mut HashSet<String>,
        ) -> Result<()> {
            if done.contains(name) {
                return Ok(());
            }
            let Some(Symbol::Type(def)) = g.symbols.get(name) else {
                return Ok(());
            };
            stack.push(name.to_owned());
            for (dep, pos) in g.direct_deps(def) {
                if let Some(i) = stack.iter().position(|s| *s == dep) {
                    let mut cycle = stack[i..].to_vec();
                    cycle.push(dep.clone());
                    return g.err(
                        pos,
                        format!(
                            "type '{dep}' contains itself without indirection ({}); use an optional '*' or a variable-length array to break the cycle",
                            cycle.join(" -> ")
                        ),
                    );
                }
                visit(g, &dep, stack, done)?;
            }
            stack.pop();
            done.insert(name.to_owned());
            Ok(())
        }
        let mut done = HashSet::new();
        for def in self.defs {
            if matches!(
                def,
                Def::Struct { .. } | Def::Union { .. } | Def::Typedef { .. }
            ) {
                visit(self, def.name(), &mut Vec::new(), &mut done)?;
            }
        }
        Ok(())
    }

    // ----- output -----

    fn line(&mut self, s: &str) {
        self.out.push_str(s);
        self.out.push('\n');
    }

    pub(crate) fn generate(mut self) -> Result<String> {
        self.line(&format!(
            "#[allow(unused_imports)]\nuse {X}::{{XdrDecode as _, XdrEncode as _}};"
        ));
        for def in self.defs {
            match def {
                Def::Struct { fields, .. } => fields.iter().try_for_each(|f| self.check_decl(f))?,
                Def::Typedef { decl, .. } => self.check_decl(decl)?,
                Def::Union { arms, default, .. } => arms
                    .iter()
                    .map(|a| &a.decl)
                    .chain(default)
                    .filter(|d| d.ty != BaseType::Void)
                    .try_for_each(|d| self.check_decl(d))?,
                _ => {}
            }
        }
        self.check_recursion()?;
        for def in self.defs {
            match def {
                Def::Const { name, pos, value } => self.gen_const(name, *pos, value)?,
                Def::Enum { .. } => self.gen_enum(def)?,
                Def::Struct { name, pos, fields } => self.gen_struct(name, *pos, fields)?,
                Def::Union {
                    name,
                    pos,
                    disc,
                    arms,
                    default,
                } => self.gen_union(name, *pos, disc, arms, default.as_ref())?,
                Def::Typedef { name, pos, decl } => self.gen_typedef(name, *pos, decl)?,
                Def::Program(p) => self.gen_program(p)?,
                Def::StrConst { name, pos, text } => {
                    let rust = upper(name);
                    self.claim("value", &rust, name, *pos)?;
                    self.line(&format!(
                        "/// `const {name}`.\npub const {rust}: &str = \"{text}\";"
                    ));
                }
            }
        }
        Ok(self.out)
    }

    fn gen_const(&mut self, name: &str, pos: Pos, value: &Value) -> Result<()> {
        let v = self.eval(value)?;
        let rust = upper(name);
        self.claim("value", &rust, name, pos)?;
        let ty = if (0..=i128::from(u32::MAX)).contains(&v) {
            "u32"
        } else if (i128::from(i32::MIN)..0).contains(&v) {
            "i32"
        } else if (0..=i128::from(u64::MAX)).contains(&v) {
            "u64"
        } else if (i128::from(i64::MIN)..0).contains(&v) {
            "i64"
        } else {
            return self.err(
                value.pos,
                format!("constant '{name}' = {v} does not fit in 64 bits"),
            );
        };
        let text = match value.kind {
            ValueKind::Lit { hex: true, .. } if v >= 0 => format!("{v:#x}"),
            _ => v.to_string(),
        };
        self.line(&format!(
            "/// `const {name}`.\npub const {rust}: {ty} = {text};"
        ));
        Ok(())
    }

    fn gen_enum(&mut self, def: &'a Def) -> Result<()> {
        let Def::Enum { name, pos, members } = def else {
            return Ok(());
        };
        let rust = type_name(name);
        self.claim("type", &rust, name, *pos)?;
        let ns = format!("variant {rust}");
        let mut variants = String::new();
        let mut aliases = String::new();
        let mut arms = String::new();
        let mut seen: BTreeMap<i32, String> = BTreeMap::new();
        for (i, m) in members.iter().enumerate() {
            let v = self.eval(&Value {
                kind: ValueKind::Name(m.name.clone()),
                pos: m.pos,
            })?;
            let Ok(v) = i32::try_from(v) else {
                return self.err(
                    m.pos,
                    format!(
                        "value {v} of enumerator '{}' does not fit in a 32-bit int",
                        m.name
                    ),
                );
            };
            if let Some(first) = seen.get(&v) {
                // A second name for a value: an associated constant.
                let c = upper(&m.name);
                self.claim(&ns, &c, &m.name, m.pos)?;
                let _ = writeln!(
                    aliases,
                    "/// `{}` = {v}, same as [`Self::{first}`].\npub const {c}: Self = Self::{first};",
                    m.name
                );
                continue;
            }
            let var = camel(&m.name);
            self.claim(&ns, &var, &m.name, m.pos)?;
            let _ = writeln!(
                variants,
                "/// `{}` = {v}\n{}{var} = {v},",
                m.name,
                if i == 0 { "#[default] " } else { "" }
            );
            let _ = writeln!(arms, "{v} => Ok(Self::{var}),");
            seen.insert(v, var);
        }
        self.line(&format!(
            "/// XDR `enum {name}`.\n#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]\n#[repr(i32)]\npub enum {rust} {{\n{variants}}}"
        ));
        if !aliases.is_empty() {
            self.line(&format!("impl {rust} {{\n{aliases}}}"));
        }
        self.line(&format!(
            "impl ::core::convert::TryFrom<i32> for {rust} {{\n type Error = {X}::Error;\n fn try_from(v: i32) -> Result<Self, {X}::Error> {{\n match v {{\n{arms} _ => Err({X}::Error::UnknownDiscriminant {{ type_name: \"{rust}\", value: i64::from(v) }}),\n}}\n}}\n}}\n\
             impl ::core::convert::From<{rust}> for i32 {{\n fn from(v: {rust}) -> i32 {{ v as i32 }}\n}}\n\
             impl {X}::XdrEncode for {rust} {{\n fn encode(&self, enc: &mut {X}::Encoder) -> {X}::Result<()> {{\n enc.put_i32(*self as i32);\n Ok(())\n}}\n}}\n\
             impl {X}::XdrDecode for {rust} {{\n fn decode(dec: &mut {X}::Decoder) -> {X}::Result<Self> {{\n Self::try_from(dec.get_i32()?)\n}}\n}}"
        ));
        Ok(())
    }

    fn gen_struct(&mut self, name: &str, pos: Pos, fields: &[Decl]) -> Result<()> {
        let rust = type_name(name);
        self.claim("type", &rust, name, pos)?;
        let ns = format!("field {rust}");
        let mut decls = String::new();
        let mut enc = String::new();
        let mut dec = String::new();
        for f in fields {
            let fname = snake(&f.name);
            self.claim(&ns, &fname, &f.name, f.pos)?;
            let _ = writeln!(
                decls,
                "/// `{}`\npub {fname}: {},",
                f.name,
                self.decl_rust(f)?
            );
            let _ = writeln!(
                enc,
                "{}",
                self.enc_decl(f, &Place::field(&format!("self.{fname}")))?
                    .stmt()
            );
            let _ = writeln!(dec, "{fname}: {}?,", self.dec_decl(f)?);
        }
        let default = if fields.iter().all(|f| self.decl_default(f)) {
            ", Default"
        } else {
            ""
        };
        self.line(&format!(
            "/// XDR `struct {name}`.\n#[derive(Debug, Clone, PartialEq{default})]\npub struct {rust} {{\n{decls}}}\n\
             impl {X}::XdrEncode for {rust} {{\n fn encode(&self, enc: &mut {X}::Encoder) -> {X}::Result<()> {{\n{enc} Ok(())\n}}\n}}\n\
             impl {X}::XdrDecode for {rust} {{\n fn decode(dec: &mut {X}::Decoder) -> {X}::Result<Self> {{\n Ok(Self {{\n{dec}}})\n}}\n}}"
        ));
        Ok(())
    }

    pub(crate) fn disc_kind(&self, d: &Decl) -> Result<Disc> {
        let bad = || {
            self.err(
                d.ty_pos,
                format!(
                    "a union discriminant must be int, unsigned int, bool or an enum, found {}",
                    d.ty.describe()
                ),
            )
        };
        if d.shape != Shape::Plain {
            return bad();
        }
        match &d.ty {
            BaseType::Int => Ok(Disc::Int),
            BaseType::UInt => Ok(Disc::UInt),
            BaseType::Bool => Ok(Disc::Bool),
            BaseType::Named(n) => match self.lookup_type(n, d.ty_pos)? {
                Def::Enum { .. } => Ok(Disc::Enum(n.clone())),
                Def::Typedef { decl, .. } => self.disc_kind(&Decl {
                    ty_pos: d.ty_pos,
                    ..decl.clone()
                }),
                _ => bad(),
            },
            _ => bad(),
        }
    }

    /// The variant name a case label gets.
    pub(crate) fn label_variant(&self, disc: &Disc, label: &Value, v: i128) -> String {
        match (disc, &label.kind) {
            (Disc::Bool, _) => if v == 0 { "False" } else { "True" }.to_owned(),
            (_, ValueKind::Name(n)) => camel(n),
            (Disc::Enum(e), ValueKind::Lit { .. }) => {
                let member = self.symbols.get(e.as_str()).and_then(|s| match s {
                    Symbol::Type(Def::Enum { members, .. }) => members.iter().find(|m| {
                        self.eval(&Value {
                            kind: ValueKind::Name(m.name.clone()),
                            pos: m.pos,
                        })
                        .ok()
                            == Some(v)
                    }),
                    _ => None,
                });
                member.map_or_else(|| lit_variant(v), |m| camel(&m.name))
            }
            _ => lit_variant(v),
        }
    }

    fn gen_union(
        &mut self,
        name: &str,
        pos: Pos,
        disc: &Decl,
        arms: &[crate::ast::Arm],
        default: Option<&Decl>,
    ) -> Result<()> {
        let rust = type_name(name);
        self.claim("type", &rust, name, pos)?;
        let kind = self.disc_kind(disc)?;
        let ns = format!("variant {rust}");
        let (disc_ty, get, put) = match &kind {
            Disc::Int => ("i32".to_owned(), "dec.get_i32()?", "enc.put_i32"),
            Disc::UInt => ("u32".to_owned(), "dec.get_u32()?", "enc.put_u32"),
            Disc::Bool => ("bool".to_owned(), "dec.get_bool()?", "enc.put_bool"),
            Disc::Enum(e) => (type_name(e), "dec.get_i32()?", "enc.put_i32"),
        };
        let enum_values: Option<HashSet<i128>> = match &kind {
            Disc::Enum(e) => match self.symbols.get(e.as_str()) {
                Some(Symbol::Type(Def::Enum { members, .. })) => Some(
                    members
                        .iter()
                        .map(|m| {
                            self.eval(&Value {
                                kind: ValueKind::Name(m.name.clone()),
                                pos: m.pos,
                            })
                        })
                        .collect::<Result<_>>()?,
                ),
                _ => None,
            },
            _ => None,
        };
        let mut variants = String::new();
        let mut enc_arms = String::new();
        let mut dec_arms = String::new();
        let mut seen: HashMap<i128, Pos> = HashMap::new();
        for arm in arms {
            let payload = self.payload_rust(&arm.decl)?;
            for label in &arm.labels {
                let v = self.eval(label)?;
                let ok = match &kind {
                    Disc::Int => i32::try_from(v).is_ok(),
                    Disc::UInt => u32::try_from(v).is_ok(),
                    Disc::Bool => v == 0 || v == 1,
                    Disc::Enum(_) => enum_values.as_ref().is_some_and(|s| s.contains(&v)),
                };
                if !ok {
                    let expected = match &kind {
                        Disc::Int => "a 32-bit int".to_owned(),
                        Disc::UInt => "an unsigned 32-bit int".to_owned(),
                        Disc::Bool => "TRUE or FALSE".to_owned(),
                        Disc::Enum(e) => format!("a value of enum '{e}'"),
                    };
                    return self.err(
                        label.pos,
                        format!("case label {v} in union '{name}' is not {expected}"),
                    );
                }
                if let Some(first) = seen.get(&v) {
                    return self.err(
                        label.pos,
                        format!(
                            "duplicate case label {v} in union '{name}' (first at {})",
                            self.files.describe(*first)
                        ),
                    );
                }
                seen.insert(v, label.pos);
                let var = self.label_variant(&kind, label, v);
                let label_text = match &label.kind {
                    ValueKind::Name(n) => n.clone(),
                    ValueKind::Lit { .. } => v.to_string(),
                };
                self.claim(&ns, &var, &label_text, label.pos)?;
                let lit = disc_literal(&kind, v);
                let pat = if kind == Disc::Bool {
                    lit.clone()
                } else {
                    v.to_string()
                };
                match &payload {
                    Some(ty) => {
                        let _ = writeln!(
                            variants,
                            "/// `case {label_text}: {}`\n{var}({ty}),",
                            arm.decl.name
                        );
                        let _ = writeln!(
                            enc_arms,
                            "Self::{var}(v) => {{ {put}({lit}); {} }}",
                            self.enc_decl(&arm.decl, &Place::reference("v"))?.stmt()
                        );
                        let _ = writeln!(
                            dec_arms,
                            "{pat} => {}.map(Self::{var}),",
                            self.dec_decl(&arm.decl)?
                        );
                    }
                    None => {
                        let _ = writeln!(variants, "/// `case {label_text}: void`\n{var},");
                        let _ = writeln!(enc_arms, "Self::{var} => {put}({lit}),");
                        let _ = writeln!(dec_arms, "{pat} => Ok(Self::{var}),");
                    }
                }
            }
        }
        let disc_put_default = match &kind {
            Disc::Enum(_) => "discriminant.encode(enc)?;".to_owned(),
            _ => format!("{put}(*discriminant);"),
        };
        let disc_from_wire = match &kind {
            Disc::Enum(e) => format!("{}::try_from(disc)?", type_name(e)),
            _ => "disc".to_owned(),
        };
        let all_bool = kind == Disc::Bool && seen.len() == 2;
        match default {
            Some(d) => {
                self.claim(&ns, "Default", "default", d.pos)?;
                if d.ty == BaseType::Void {
                    let _ = writeln!(
                        variants,
                        "/// `default: void`\nDefault {{ discriminant: {disc_ty} }},"
                    );
                    let _ = writeln!(
                        enc_arms,
                        "Self::Default {{ discriminant }} => {{ {disc_put_default} }}"
                    );
                    if !all_bool {
                        let _ = writeln!(
                            dec_arms,
                            "_ => Ok(Self::Default {{ discriminant: {disc_from_wire} }}),"
                        );
                    }
                } else {
                    let ty = self.decl_rust(d)?;
                    let _ = writeln!(
                        variants,
                        "/// `default: {}`\nDefault {{ discriminant: {disc_ty}, value: {ty} }},",
                        d.name
                    );
                    let _ = writeln!(
                        enc_arms,
                        "Self::Default {{ discriminant, value }} => {{ {disc_put_default} {} }}",
                        self.enc_decl(d, &Place::reference("value"))?.stmt()
                    );
                    if !all_bool {
                        let _ = writeln!(
                            dec_arms,
                            "_ => Ok(Self::Default {{ discriminant: {disc_from_wire}, value: {}? }}),",
                            self.dec_decl(d)?
                        );
                    }
                }
            }
            None if !all_bool => {
                let wire = if kind == Disc::Bool {
                    "i64::from(u8::from(disc))"
                } else {
                    "i64::from(disc)"
                };
                let _ = writeln!(
                    dec_arms,
                    "_ => Err({X}::Error::UnknownDiscriminant {{ type_name: \"{rust}\", value: {wire} }}),"
                );
            }
            None => {}
        }
        self.line(&format!(
            "/// XDR `union {name} switch ({} {})`.\n#[derive(Debug, Clone, PartialEq)]\npub enum {rust} {{\n{variants}}}\n\
             impl {X}::XdrEncode for {rust} {{\n fn encode(&self, enc: &mut {X}::Encoder) -> {X}::Result<()> {{\n match self {{\n{enc_arms}}}\n Ok(())\n}}\n}}\n\
             impl {X}::XdrDecode for {rust} {{\n fn decode(dec: &mut {X}::Decoder) -> {X}::Result<Self> {{\n let disc = {get};\n match disc {{\n{dec_arms}}}\n}}\n}}",
            disc.ty.describe().trim_matches('\''),
            disc.name
        ));
        Ok(())
    }

    fn gen_typedef(&mut self, name: &str, pos: Pos, decl: &Decl) -> Result<()> {
        let rust = type_name(name);
        self.claim("type", &rust, name, pos)?;
        let f = snake_fn(name);
        self.claim("value", &format!("encode_{f}"), name, pos)?;
        self.claim("value", &format!("decode_{f}"), name, pos)?;
        let ty = self.decl_rust(decl)?;
        let enc = self.enc_decl(decl, &Place::reference("v"))?;
        let body = if enc.fallible {
            enc.code
        } else {
            format!("{};\nOk(())", enc.code)
        };
        let dec = self.dec_decl(decl)?;
        self.line(&format!(
            "/// XDR `typedef {name}`.\npub type {rust} = {ty};\n\
             /// Encodes a [`{rust}`], applying the typedef's bounds.\npub fn encode_{f}(v: &{rust}, enc: &mut {X}::Encoder) -> {X}::Result<()> {{\n{body}\n}}\n\
             /// Decodes a [`{rust}`], applying the typedef's bounds.\npub fn decode_{f}(dec: &mut {X}::Decoder) -> {X}::Result<{rust}> {{\n{dec}\n}}"
        ));
        Ok(())
    }

    /// Emits `pub const NAME: u32 = n;` once per name (rpcgen repeats procedure names across
    /// versions with the same number).
    fn number_const(&mut self, c_name: &str, pos: Pos, n: u32, what: &str) -> Result<String> {
        let rust = upper(c_name);
        if let Some((prev, prev_c, prev_pos)) = self.number_consts.get(&rust) {
            if *prev == n && prev_c == c_name {
                return Ok(rust);
            }
            return self.err(
                pos,
                format!(
                    "'{c_name}' = {n} conflicts with '{prev_c}' = {prev} (at {}): both become the Rust constant `{rust}`",
                    self.files.describe(*prev_pos)
                ),
            );
        }
        self.claim("value", &rust, c_name, pos)?;
        self.number_consts
            .insert(rust.clone(), (n, c_name.to_owned(), pos));
        self.line(&format!(
            "/// {what} `{c_name}`.\npub const {rust}: u32 = {n};"
        ));
        Ok(rust)
    }

    fn proc_number(&self, v: &Value, what: &str) -> Result<u32> {
        let n = self.eval(v)?;
        u32::try_from(n).or_else(|_| {
            self.err(
                v.pos,
                format!("{what} must fit in an unsigned 32-bit integer, found {n}"),
            )
        })
    }

    /// The number of `kind` `name` (declared at `pos`), which must not be in `seen`, the
    /// numbers of the other ones of `of` (kind, name); it is added there.
    fn unique_number(
        &self,
        seen: &mut HashMap<u32, Pos>,
        kind: &str,
        name: &str,
        pos: Pos,
        number: &Value,
        of: (&str, &str),
    ) -> Result<u32> {
        let n = self.proc_number(number, &format!("the number of {kind} '{name}'"))?;
        if let Some(prev) = seen.insert(n, pos) {
            return self.err(
                number.pos,
                format!(
                    "{kind} number {n} of {} '{}' is already used (at {})",
                    of.0,
                    of.1,
                    self.files.describe(prev)
                ),
            );
        }
        Ok(n)
    }

    fn gen_program(&mut self, p: &Program) -> Result<()> {
        let pnum = self.proc_number(&p.number, &format!("the number of program '{}'", p.name))?;
        let pconst = self.number_const(&p.name, p.pos, pnum, "Program number")?;
        let mut vnums: HashMap<u32, Pos> = HashMap::new();
        for v in &p.versions {
            let of = ("program", p.name.as_str());
            let vnum = self.unique_number(&mut vnums, "version", &v.name, v.pos, &v.number, of)?;
            let vconst = self.number_const(&v.name, v.pos, vnum, "Version number")?;
            let base = type_name(&v.name);
            let client = format!("{base}Client");
            let server = format!("{base}Server");
            let service = format!("{base}Service");
            for n in [&client, &server, &service] {
                self.claim("type", n, &v.name, v.pos)?;
            }
            let method_ns = format!("method {client}");
            for reserved in ["new", "with_timeout", "rpc", "timeout"] {
                self.claim(
                    &method_ns,
                    reserved,
                    &format!("the client's own method `{reserved}`"),
                    v.pos,
                )?;
            }
            let mut pnums: HashMap<u32, Pos> = HashMap::new();
            let mut client_methods = String::new();
            let mut trait_methods = String::new();
            let mut names = String::new();
            let mut dispatch = String::new();
            for pr in &v.procs {
                let of = ("version", v.name.as_str());
                let n =
                    self.unique_number(&mut pnums, "procedure", &pr.name, pr.pos, &pr.number, of)?;
                if pr.oneway && pr.result.ty != BaseType::Void {
                    return self.err(
                        pr.result.ty_pos,
                        format!(
                            "one-way procedure '{}' must return void, found {}",
                            pr.name,
                            pr.result.ty.describe()
                        ),
                    );
                }
                let pc = self.number_const(&pr.name, pr.pos, n, "Procedure number")?;
                let method = snake(&pr.name);
                self.claim(&method_ns, &method, &pr.name, pr.pos)?;
                for a in pr.args.iter().chain([&pr.result]) {
                    if a.ty != BaseType::Void {
                        self.check_decl(a)?;
                    }
                }
                let arg_names: Vec<String> = if pr.args.len() == 1 {
                    vec!["arg".to_owned()]
                } else {
                    (1..=pr.args.len()).map(|i| format!("arg{i}")).collect()
                };
                let mut params_ref = String::new();
                let mut params_owned = String::new();
                let mut enc_stmts = String::new();
                let mut dec_stmts = String::new();
                for (a, an) in pr.args.iter().zip(&arg_names) {
                    let ty = self.decl_rust(a)?;
                    let _ = write!(params_ref, ", {an}: &{ty}");
                    let _ = write!(params_owned, ", {an}: {ty}");
                    let _ = writeln!(
                        enc_stmts,
                        "{}",
                        self.enc_decl(a, &Place::reference(an))?.stmt()
                    );
                    let _ = writeln!(
                        dec_stmts,
                        "let Ok({an}) = {} else {{ return {RPC}::Dispatch::GarbageArgs; }};",
                        self.dec_decl(a)?
                    );
                }
                let args_closure = match pr.args.len() {
                    0 => "|_| Ok(())".to_owned(),
                    1 => format!(
                        "|enc| {}",
                        self.enc_decl(&pr.args[0], &Place::reference("arg"))?
                            .result()
                    ),
                    _ => format!("|enc| {{\n{enc_stmts}Ok(())\n}}"),
                };
                let (ret, result_closure, enc_result) = if pr.result.ty == BaseType::Void {
                    ("()".to_owned(), "|_| Ok(())".to_owned(), None)
                } else {
                    (
                        self.decl_rust(&pr.result)?,
                        format!("|dec| {}", self.dec_decl(&pr.result)?),
                        Some(self.enc_decl(&pr.result, &Place::reference("res"))?),
                    )
                };
                let sig_doc = format!(
                    "/// `{} {}({}) = {n}`{}",
                    pr.result.ty.describe().trim_matches('\''),
                    pr.name,
                    if pr.args.is_empty() {
                        "void".to_owned()
                    } else {
                        pr.args
                            .iter()
                            .map(|a| a.ty.describe().trim_matches('\'').to_owned())
                            .collect::<Vec<_>>()
                            .join(", ")
                    },
                    if pr.oneway {
                        " (one-way: no reply is awaited)"
                    } else {
                        ""
                    }
                );
                let call_args: String = arg_names.iter().map(|a| format!(", {a}")).collect();
                if pr.oneway {
                    let _ = writeln!(
                        client_methods,
                        "{sig_doc}\npub fn {method}(&self{params_ref}) -> Result<(), {RPC}::RpcError> {{\n self.rpc.call_oneway({pconst}, {vconst}, {pc}, {args_closure})\n}}"
                    );
                    let _ = writeln!(
                        dispatch,
                        "{pc} => {{\n{dec_stmts}if dec.finish().is_err() {{ return {RPC}::Dispatch::GarbageArgs; }}\nlet _ = self.inner.{method}(ctx{call_args});\n{RPC}::Dispatch::NoReply\n}}"
                    );
                } else {
                    let _ = writeln!(
                        client_methods,
                        "{sig_doc}\npub fn {method}(&self{params_ref}) -> Result<{ret}, {RPC}::RpcError> {{\n self.rpc.call({pconst}, {vconst}, {pc}, self.timeout, {args_closure}, {result_closure})\n}}"
                    );
                    let reply = match &enc_result {
                        Some(e) if e.fallible => format!(
                            "Ok(res) => {{\n let res = &res;\n match {} {{\n Ok(()) => {RPC}::Dispatch::Success,\n Err(_) => {RPC}::Dispatch::SystemErr,\n}}\n}}",
                            e.code
                        ),
                        Some(e) => format!(
                            "Ok(res) => {{\n let res = &res;\n {};\n {RPC}::Dispatch::Success\n}}",
                            e.code
                        ),
                        None => format!("Ok(()) => {RPC}::Dispatch::Success,"),
                    };
                    let _ = writeln!(
                        dispatch,
                        "{pc} => {{\n{dec_stmts}if dec.finish().is_err() {{ return {RPC}::Dispatch::GarbageArgs; }}\nmatch self.inner.{method}(ctx{call_args}) {{\n{reply}\nErr(e) => proc_error_dispatch(&e),\n}}\n}}"
                    );
                }
                let _ = writeln!(
                    trait_methods,
                    "{sig_doc}\nfn {method}(&self, ctx: &{RPC}::CallContext{params_owned}) -> {RPC}::ProcResult<{ret}>;"
                );
                let _ = writeln!(names, "{pc} => Some({:?}),", pr.name);
            }
            if !pnums.contains_key(&0) {
                let _ = writeln!(dispatch, "0 => {RPC}::Dispatch::Success,");
                let _ = writeln!(names, "0 => Some(\"NULL\"),");
            }
            let title = format!(
                "version `{}` ({vnum}) of program `{}` ({pnum})",
                v.name, p.name
            );
            self.line(&format!(
                "/// Client for {title}.\n#[derive(Debug, Clone)]\npub struct {client} {{\n rpc: {RPC}::Client,\n timeout: Option<::std::time::Duration>,\n}}\n\
                 impl {client} {{\n/// The program number.\npub const PROGRAM: u32 = {pconst};\n/// The version number.\npub const VERSION: u32 = {vconst};\n\
                 /// A client making calls over `rpc` with the connection's default timeout.\npub fn new(rpc: {RPC}::Client) -> Self {{ Self {{ rpc, timeout: None }} }}\n\
                 /// Uses `timeout` for every call instead of the connection's default.\npub fn with_timeout(mut self, timeout: ::std::time::Duration) -> Self {{ self.timeout = Some(timeout); self }}\n\
                 /// The underlying connection.\npub fn rpc(&self) -> &{RPC}::Client {{ &self.rpc }}\n\
                 /// The per-call timeout, if set.\npub fn timeout(&self) -> Option<::std::time::Duration> {{ self.timeout }}\n{client_methods}}}\n\
                 /// Server side of {title}: implement it and serve it with [`{service}`].\npub trait {server}: Send + Sync + 'static {{\n{trait_methods}}}\n\
                 /// Adapts a [`{server}`] to [`{RPC}::Service`]: decodes arguments, calls the handler, encodes the result.\n#[derive(Debug, Clone)]\npub struct {service}<S> {{\n inner: S,\n}}\n\
                 impl<S: {server}> {service}<S> {{\n/// Wraps a handler.\npub fn new(inner: S) -> Self {{ Self {{ inner }} }}\n/// The handler.\npub fn inner(&self) -> &S {{ &self.inner }}\n/// Unwraps the handler.\npub fn into_inner(self) -> S {{ self.inner }}\n}}\n\
                 impl<S: {server}> {RPC}::Service for {service}<S> {{\n fn program(&self) -> u32 {{ {pconst} }}\n fn version(&self) -> u32 {{ {vconst} }}\n\
                 fn dispatch(&self, ctx: &{RPC}::CallContext, dec: &mut {X}::Decoder, enc: &mut {X}::Encoder) -> {RPC}::Dispatch {{\n\
                 fn proc_error_dispatch(e: &{RPC}::ProcError) -> {RPC}::Dispatch {{\n {RPC}::Dispatch::from(e.clone())\n}}\n\
                 let _ = &enc;\n match ctx.procedure {{\n{dispatch} _ => {RPC}::Dispatch::ProcUnavail,\n}}\n}}\n\
                 fn procedure_name(&self, procedure: u32) -> Option<&'static str> {{\n match procedure {{\n{names} _ => None,\n}}\n}}\n}}"
            ));
        }
        Ok(())
    }
}

/// The snake-case stem of a typedef's `encode_`/`decode_` functions (without `r#`).
fn snake_fn(name: &str) -> String {
    let s = snake(name);
    s.strip_prefix("r#").map(str::to_owned).unwrap_or(s)
}

fn lit_variant(v: i128) -> String {
    if v < 0 {
        format!("CaseNeg{}", v.unsigned_abs())
    } else {
        format!("Case{v}")
    }
}

fn disc_literal(kind: &Disc, v: i128) -> String {
    match kind {
        Disc::Bool => (v != 0).to_string(),
        _ => v.to_string(),
    }
}

/// Turns generated source text into formatted Rust, with the header.
pub(crate) fn format_source(source_name: &str, code: &str) -> Result<String> {
    let file = syn::parse_file(code)
        .map_err(|e| Error::Internal(format!("generated code does not parse: {e}\n{code}")))?;
    Ok(format!(
        "{}{}",
        header(source_name),
        prettyplease::unparse(&file)
    ))
}

/// The first line of every generated file.
pub(crate) fn header(source_name: &str) -> String {
    format!("{}{source_name}. Do not edit.\n\n", crate::HEADER_PREFIX)
}
