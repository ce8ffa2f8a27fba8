//! The emulated **test** backend's module format (UTF-8 text): a first line
//! [`EMU_MODULE_MAGIC`], then lines `func NAME SIZE,SIZE,...` (parameters, each aligned to its
//! size up to 8) and `global NAME BYTES`.

use remora_proto::cuda::{CuError, CuResult, cu};

use super::{EMU_MODULE_MAGIC, align_up};

/// Parses the test module format: `(functions, globals)`.
pub(super) type ParsedModule = (Vec<(String, Vec<(u32, u32)>)>, Vec<(String, u64)>);

pub(super) fn parse_module(image: &[u8]) -> CuResult<ParsedModule> {
    let Ok(text) = std::str::from_utf8(image) else {
        return Ok((Vec::new(), Vec::new()));
    };
    // Text images reach the server with their NUL terminator (as PTX does through the shim).
    let mut lines = text.trim_end_matches('\0').lines();
    if lines.next() != Some(EMU_MODULE_MAGIC) {
        return Ok((Vec::new(), Vec::new()));
    }
    let (mut funcs, mut globals) = (Vec::new(), Vec::new());
    for line in lines {
        let mut words = line.split_whitespace();
        match (words.next(), words.next(), words.next()) {
            (Some("func"), Some(name), sizes) => {
                let mut params = Vec::new();
                let mut offset = 0u32;
                for s in sizes.unwrap_or("").split(',').filter(|s| !s.is_empty()) {
                    let size: u32 = s.parse().map_err(|_| CuError(cu::INVALID_IMAGE))?;
                    if size == 0 || size > remora_proto::remora::RM_MAX_PARAMS {
                        return Err(CuError(cu::INVALID_IMAGE));
                    }
                    offset = align_up(u64::from(offset), u64::from(size.min(8))) as u32;
                    params.push((offset, size));
                    offset += size;
                }
                funcs.push((name.to_owned(), params));
            }
            (Some("global"), Some(name), Some(size)) => {
                globals.push((
                    name.to_owned(),
                    size.parse().map_err(|_| CuError(cu::INVALID_IMAGE))?,
                ));
            }
            (None, ..) => {}
            _ => return Err(CuError(cu::INVALID_IMAGE)),
        }
    }
    Ok((funcs, globals))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_test_module_format() {
        let (f, g) = parse_module(b"REMORA-EMU-MODULE\nfunc k 4,8,1,8\nglobal g 16\n").unwrap();
        assert_eq!(f, [("k".into(), vec![(0, 4), (8, 8), (16, 1), (24, 8)])]);
        assert_eq!(g, [("g".into(), 16)]);
        assert_eq!(parse_module(b"\x7fELF...").unwrap(), (vec![], vec![]));
        assert_eq!(
            parse_module(b"REMORA-EMU-MODULE\nbogus\n"),
            Err(CuError(cu::INVALID_IMAGE))
        );
    }
}
