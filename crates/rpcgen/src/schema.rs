//! A description of a specification's procedures and types with the Rust names the generator
//! gives them, for generators that build on the generated code (Remora's per-call glue).

use std::collections::BTreeMap;

/// The procedures (of every program and version) and named types of a specification.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Schema {
    /// In declaration order.
    pub procedures: Vec<Procedure>,
    /// By RPCL name.
    pub types: BTreeMap<String, TypeInfo>,
}

/// One procedure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Procedure {
    /// As written, e.g. `RM_CTX_GET_LIMIT`.
    pub name: String,
    /// The generated client and server method, e.g. `rm_ctx_get_limit`.
    pub method: String,
    /// Each argument: its RPCL type name when it is a plain named type, and its Rust type.
    pub args: Vec<(Option<String>, String)>,
    /// The result likewise; `None` for `void`.
    pub result: Option<(Option<String>, String)>,
    /// Marked `@oneway`.
    pub oneway: bool,
}

/// A named type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TypeInfo {
    /// A struct: its Rust name and `(field, Rust type)` in order.
    Struct {
        rust: String,
        fields: Vec<(String, String)>,
    },
    /// A union: its Rust name, one arm per case label, and whether `default` is `void`
    /// (`None`: no default arm).
    Union {
        rust: String,
        arms: Vec<UnionArm>,
        default_void: Option<bool>,
    },
    /// A typedef: its Rust name and the Rust type it stands for.
    Typedef { rust: String, target: String },
}

/// One case label of a union.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnionArm {
    pub label: i128,
    /// The Rust variant.
    pub variant: String,
    /// The Rust payload type; `None` for `void`.
    pub payload: Option<String>,
}

impl Schema {
    /// The procedure named `name`.
    pub fn procedure(&self, name: &str) -> Option<&Procedure> {
        self.procedures.iter().find(|p| p.name == name)
    }
}
