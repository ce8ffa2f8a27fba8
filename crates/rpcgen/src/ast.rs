//! The syntax tree of an RPCL specification.

use crate::error::Pos;

/// A constant as written: a literal or the name of a `const` or enum member.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ValueKind {
    Lit { value: i128, hex: bool },
    Name(String),
}

/// A constant and where it was written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Value {
    pub(crate) kind: ValueKind,
    pub(crate) pos: Pos,
}

/// A type specifier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum BaseType {
    Int,
    UInt,
    Hyper,
    UHyper,
    Float,
    Double,
    Bool,
    /// rpcgen `char`: an `int` on the wire, `i8` in Rust.
    Char,
    UChar,
    Short,
    UShort,
    Opaque,
    String,
    Void,
    Named(String),
}

impl BaseType {
    pub(crate) fn describe(&self) -> String {
        match self {
            BaseType::Int => "int".into(),
            BaseType::UInt => "unsigned int".into(),
            BaseType::Hyper => "hyper".into(),
            BaseType::UHyper => "unsigned hyper".into(),
            BaseType::Float => "float".into(),
            BaseType::Double => "double".into(),
            BaseType::Bool => "bool".into(),
            BaseType::Char => "char".into(),
            BaseType::UChar => "unsigned char".into(),
            BaseType::Short => "short".into(),
            BaseType::UShort => "unsigned short".into(),
            BaseType::Opaque => "opaque".into(),
            BaseType::String => "string".into(),
            BaseType::Void => "void".into(),
            BaseType::Named(n) => format!("'{n}'"),
        }
    }
}

/// How a declaration wraps its type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Shape {
    Plain,
    /// `x[n]`
    Fixed(Value),
    /// `x<n>` or `x<>`
    Var(Option<Value>),
    /// `*x`
    Optional,
}

/// A declaration: a field, union arm, typedef body, or procedure argument/result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Decl {
    /// Empty for `void` and unnamed procedure arguments.
    pub(crate) name: String,
    pub(crate) pos: Pos,
    pub(crate) ty: BaseType,
    pub(crate) ty_pos: Pos,
    pub(crate) shape: Shape,
}

/// An enum member.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Member {
    pub(crate) name: String,
    pub(crate) pos: Pos,
    /// `None` when the value was omitted (rpcgen: previous value plus one).
    pub(crate) value: Option<Value>,
}

/// A union arm: one or more case labels sharing one declaration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Arm {
    pub(crate) labels: Vec<Value>,
    pub(crate) decl: Decl,
}

/// A procedure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Proc {
    pub(crate) name: String,
    pub(crate) pos: Pos,
    pub(crate) number: Value,
    /// No entries for `void`.
    pub(crate) args: Vec<Decl>,
    pub(crate) result: Decl,
    pub(crate) oneway: bool,
}

/// A program version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Version {
    pub(crate) name: String,
    pub(crate) pos: Pos,
    pub(crate) number: Value,
    pub(crate) procs: Vec<Proc>,
}

/// A program.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Program {
    pub(crate) name: String,
    pub(crate) pos: Pos,
    pub(crate) number: Value,
    pub(crate) versions: Vec<Version>,
}

/// A top-level definition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Def {
    Const {
        name: String,
        pos: Pos,
        value: Value,
    },
    /// `const NAME = "text";` (rpcgen passes these through to C).
    StrConst {
        name: String,
        pos: Pos,
        text: String,
    },
    Enum {
        name: String,
        pos: Pos,
        members: Vec<Member>,
    },
    Struct {
        name: String,
        pos: Pos,
        fields: Vec<Decl>,
    },
    Union {
        name: String,
        pos: Pos,
        disc: Decl,
        arms: Vec<Arm>,
        default: Option<Decl>,
    },
    Typedef {
        name: String,
        pos: Pos,
        decl: Decl,
    },
    Program(Program),
}

impl Def {
    pub(crate) fn name(&self) -> &str {
        self.name_pos().0
    }

    pub(crate) fn pos(&self) -> Pos {
        self.name_pos().1
    }

    fn name_pos(&self) -> (&str, Pos) {
        match self {
            Def::Const { name, pos, .. }
            | Def::StrConst { name, pos, .. }
            | Def::Enum { name, pos, .. }
            | Def::Struct { name, pos, .. }
            | Def::Union { name, pos, .. }
            | Def::Typedef { name, pos, .. } => (name, *pos),
            Def::Program(p) => (&p.name, p.pos),
        }
    }

    pub(crate) fn set_name(&mut self, new: String) {
        match self {
            Def::Const { name, .. }
            | Def::StrConst { name, .. }
            | Def::Enum { name, .. }
            | Def::Struct { name, .. }
            | Def::Union { name, .. }
            | Def::Typedef { name, .. } => *name = new,
            Def::Program(p) => p.name = new,
        }
    }
}
