//! The Rust implementation of the rpctest service: the same behaviour as `c/rpctest_server.c`.

use remora_oncrpc::{CallContext, ProcResult};

use crate::rpctest::{Arrays, IntList, IntNode, NameList, RpctestV1Server, RtBlob, Shape};

/// Echoes, adds, reverses: the rpctest service.
#[derive(Debug, Default, Clone, Copy)]
pub struct RtService;

impl RpctestV1Server for RtService {
    fn rt_null(&self, _ctx: &CallContext) -> ProcResult<()> {
        Ok(())
    }

    fn rt_echo(&self, _ctx: &CallContext, blob: RtBlob) -> ProcResult<RtBlob> {
        // The argument is a zero-copy slice of the received record, and the reply encoder
        // sends large `Bytes` without copying: the echo touches the payload only in the kernel.
        Ok(blob)
    }

    fn rt_add(&self, _ctx: &CallContext, a: i32, b: i32) -> ProcResult<i32> {
        Ok(a.wrapping_add(b))
    }

    fn rt_shape_echo(&self, _ctx: &CallContext, shape: Shape) -> ProcResult<Shape> {
        Ok(shape)
    }

    fn rt_list_reverse(&self, _ctx: &CallContext, list: IntList) -> ProcResult<IntList> {
        let mut out: IntList = None;
        let mut cur = list;
        while let Some(mut node) = cur {
            cur = node.next.take();
            node.next = out;
            out = Some(node);
        }
        Ok(out)
    }

    fn rt_arrays_echo(&self, _ctx: &CallContext, arrays: Arrays) -> ProcResult<Arrays> {
        Ok(arrays)
    }

    fn rt_names_echo(&self, _ctx: &CallContext, names: NameList) -> ProcResult<NameList> {
        Ok(names)
    }

    fn rt_list_sum(&self, _ctx: &CallContext, list: IntList) -> ProcResult<i32> {
        let mut sum = 0i32;
        let mut cur = list.as_deref();
        while let Some(IntNode { value, next }) = cur {
            sum = sum.wrapping_add(*value);
            cur = next.as_deref();
        }
        Ok(sum)
    }
}
