//! A description of a specification's procedures and types with the Rust names the generator
//! gives them, for generators that build on the generated code (Remora's per-call glue).

use std::collections::BTreeMap;

use crate::ast::{BaseType, Decl, Def, Shape};
use crate::error::Result;
use crate::generate::Gen;
use crate::names::{snake, type_name};

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

impl Gen<'_> {
    /// The procedures and types of the specification, with their Rust names.
    pub(crate) fn schema(&self) -> Result<crate::schema::Schema> {
        let mut schema = Schema::default();
        for def in self.defs {
            match def {
                Def::Struct { name, fields, .. } => {
                    let mut out = Vec::new();
                    for f in fields {
                        out.push((snake(&f.name), self.decl_rust(f)?));
                    }
                    schema.types.insert(
                        name.clone(),
                        TypeInfo::Struct {
                            rust: type_name(name),
                            fields: out,
                        },
                    );
                }
                Def::Union {
                    name,
                    disc,
                    arms,
                    default,
                    ..
                } => {
                    let kind = self.disc_kind(disc)?;
                    let mut out = Vec::new();
                    for arm in arms {
                        let payload = self.payload_rust(&arm.decl)?;
                        for label in &arm.labels {
                            let v = self.eval(label)?;
                            out.push(UnionArm {
                                label: v,
                                variant: self.label_variant(&kind, label, v),
                                payload: payload.clone(),
                            });
                        }
                    }
                    schema.types.insert(
                        name.clone(),
                        TypeInfo::Union {
                            rust: type_name(name),
                            arms: out,
                            default_void: default.as_ref().map(|d| d.ty == BaseType::Void),
                        },
                    );
                }
                Def::Typedef { name, decl, .. } => {
                    schema.types.insert(
                        name.clone(),
                        TypeInfo::Typedef {
                            rust: type_name(name),
                            target: self.decl_rust(decl)?,
                        },
                    );
                }
                Def::Program(p) => {
                    for v in &p.versions {
                        for pr in &v.procs {
                            let named = |d: &Decl| match &d.ty {
                                BaseType::Named(n) if d.shape == Shape::Plain => Some(n.clone()),
                                _ => None,
                            };
                            let mut args = Vec::new();
                            for a in &pr.args {
                                args.push((named(a), self.decl_rust(a)?));
                            }
                            let result = if pr.result.ty == BaseType::Void {
                                None
                            } else {
                                Some((named(&pr.result), self.decl_rust(&pr.result)?))
                            };
                            schema.procedures.push(Procedure {
                                name: pr.name.clone(),
                                method: snake(&pr.name),
                                args,
                                result,
                                oneway: pr.oneway,
                            });
                        }
                    }
                }
                _ => {}
            }
        }
        Ok(schema)
    }
}
