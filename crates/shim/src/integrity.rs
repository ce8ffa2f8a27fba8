//! The answer of the `INTEGRITY_CHECK` export table: the CUDA runtime asks the driver for a
//! 16-byte token and checks it against its own computation.
//!
//! Public reverse engineering (ZLUDA's dark-API notes) established what the token is; this is
//! our own implementation of that description:
//! * for a request version whose last decimal digit is 0 or 1 the answer is a constant;
//! * otherwise it is HMAC (RFC 2104, block size 16) over MD2 (RFC 1319) with a fixed 16-byte
//!   key, of the message `driver version (u32) · request version (u32) · process id (u32) ·
//!   thread id (u32, the low half of pthread_self) · CUDART_INTERFACE table address ·
//!   INTEGRITY_CHECK table address · the integrity function's address · unix seconds (u64)`
//!   followed, for each device, by `UUID (16 bytes) · PCI domain · PCI bus · PCI device
//!   (i32 each)`, all little-endian; the two u64 halves of the digest are the token.

/// MD2's substitution table (RFC 1319, digits of pi).
const S: [u8; 256] = [
    41, 46, 67, 201, 162, 216, 124, 1, 61, 54, 84, 161, 236, 240, 6, 19, 98, 167, 5, 243, 192, 199,
    115, 140, 152, 147, 43, 217, 188, 76, 130, 202, 30, 155, 87, 60, 253, 212, 224, 22, 103, 66,
    111, 24, 138, 23, 229, 18, 190, 78, 196, 214, 218, 158, 222, 73, 160, 251, 245, 142, 187, 47,
    238, 122, 169, 104, 121, 145, 21, 178, 7, 63, 148, 194, 16, 137, 11, 34, 95, 33, 128, 127, 93,
    154, 90, 144, 50, 39, 53, 62, 204, 231, 191, 247, 151, 3, 255, 25, 48, 179, 72, 165, 181, 209,
    215, 94, 146, 42, 172, 86, 170, 198, 79, 184, 56, 210, 150, 164, 125, 182, 118, 252, 107, 226,
    156, 116, 4, 241, 69, 157, 112, 89, 100, 113, 135, 32, 134, 91, 207, 101, 230, 45, 168, 2, 27,
    96, 37, 173, 174, 176, 185, 246, 28, 70, 97, 105, 52, 64, 126, 15, 85, 71, 163, 35, 221, 81,
    175, 58, 195, 92, 249, 206, 186, 197, 234, 38, 44, 83, 13, 110, 133, 40, 132, 9, 211, 223, 205,
    244, 65, 129, 77, 82, 106, 220, 55, 200, 108, 193, 171, 250, 36, 225, 123, 8, 12, 189, 177, 74,
    120, 136, 149, 139, 227, 99, 232, 109, 233, 203, 213, 254, 59, 0, 29, 57, 242, 239, 183, 14,
    102, 88, 208, 228, 166, 119, 114, 248, 235, 117, 75, 10, 49, 68, 80, 180, 143, 237, 31, 26,
    219, 153, 141, 51, 159, 17, 131, 20,
];

/// An incremental MD2 (RFC 1319).
#[derive(Clone)]
pub struct Md2 {
    /// The 48-byte state; the first 16 bytes are the digest so far.
    x: [u8; 48],
    checksum: [u8; 16],
    block: [u8; 16],
    used: usize,
}

impl Default for Md2 {
    fn default() -> Self {
        Md2 {
            x: [0; 48],
            checksum: [0; 16],
            block: [0; 16],
            used: 0,
        }
    }
}

impl Md2 {
    fn compress(&mut self, block: &[u8; 16]) {
        for (j, &b) in block.iter().enumerate() {
            self.x[16 + j] = b;
            self.x[32 + j] = b ^ self.x[j];
        }
        let mut t: u8 = 0;
        for round in 0..18u8 {
            for k in 0..48 {
                self.x[k] ^= S[usize::from(t)];
                t = self.x[k];
            }
            t = t.wrapping_add(round);
        }
    }

    fn block_done(&mut self) {
        let block = self.block;
        let mut l = self.checksum[15];
        for (j, &b) in block.iter().enumerate() {
            self.checksum[j] ^= S[usize::from(b ^ l)];
            l = self.checksum[j];
        }
        self.compress(&block);
        self.used = 0;
    }

    /// Appends bytes.
    pub fn update(&mut self, data: &[u8]) {
        for &b in data {
            self.block[self.used] = b;
            self.used += 1;
            if self.used == 16 {
                self.block_done();
            }
        }
    }

    /// Pads, appends the checksum and returns the digest.
    pub fn finish(mut self) -> [u8; 16] {
        let pad = (16 - self.used) as u8;
        self.update(&vec![pad; usize::from(pad)]);
        let checksum = self.checksum;
        self.compress(&checksum);
        let mut out = [0; 16];
        out.copy_from_slice(&self.x[..16]);
        out
    }

    /// The digest state and checksum so far (for tests).
    #[cfg(test)]
    fn state(&self) -> ([u8; 16], [u8; 16]) {
        let mut x = [0; 16];
        x.copy_from_slice(&self.x[..16]);
        (x, self.checksum)
    }
}

/// The fixed HMAC key.
const KEY: [u8; 16] = [
    0x14, 0x6A, 0xDD, 0xAE, 0x53, 0xA9, 0xA7, 0x52, 0xAA, 0x08, 0x41, 0x36, 0x0B, 0xF5, 0x5A, 0x9F,
];

fn keyed(pad: u8) -> Md2 {
    let mut h = Md2::default();
    h.update(&KEY.map(|k| k ^ pad));
    h
}

/// One device's part of the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceId {
    /// `cuDeviceGetUuid`.
    pub uuid: [u8; 16],
    /// `CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID`.
    pub pci_domain: i32,
    /// `CU_DEVICE_ATTRIBUTE_PCI_BUS_ID`.
    pub pci_bus: i32,
    /// `CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID`.
    pub pci_device: i32,
}

/// Everything the token depends on.
#[derive(Debug, Clone)]
pub struct Inputs {
    /// The request's version argument.
    pub version: u32,
    /// The request's time argument.
    pub unix_seconds: u64,
    /// What `cuDriverGetVersion` answers.
    pub driver_version: u32,
    /// `getpid()`.
    pub process: u32,
    /// The low 32 bits of `pthread_self()`.
    pub thread: u32,
    /// The address of the CUDART_INTERFACE table.
    pub cudart_table: u64,
    /// The address of the INTEGRITY_CHECK table.
    pub integrity_table: u64,
    /// The address of the integrity function (slot 1 of its table).
    pub function: u64,
    /// The devices, in ordinal order.
    pub devices: Vec<DeviceId>,
}

/// The token, as the two u64 the caller's `[u64; 2]` receives.
pub fn token(i: &Inputs) -> [u64; 2] {
    match i.version % 10 {
        0 => return [0x3341181C03CB675C, 0x8ED383AA1F4CD1E8],
        1 => return [0x1841181C03CB675C, 0x8ED383AA1F4CD1E8],
        _ => {}
    }
    let mut inner = keyed(0x36);
    inner.update(&i.driver_version.to_le_bytes());
    inner.update(&i.version.to_le_bytes());
    inner.update(&i.process.to_le_bytes());
    inner.update(&i.thread.to_le_bytes());
    inner.update(&i.cudart_table.to_le_bytes());
    inner.update(&i.integrity_table.to_le_bytes());
    inner.update(&i.function.to_le_bytes());
    inner.update(&i.unix_seconds.to_le_bytes());
    for d in &i.devices {
        inner.update(&d.uuid);
        inner.update(&d.pci_domain.to_le_bytes());
        inner.update(&d.pci_bus.to_le_bytes());
        inner.update(&d.pci_device.to_le_bytes());
    }
    let mut outer = keyed(0x5C);
    outer.update(&inner.finish());
    let d = outer.finish();
    let half = |b: &[u8]| u64::from_le_bytes(b.try_into().unwrap_or([0; 8]));
    [half(&d[..8]), half(&d[8..])]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(d: [u8; 16]) -> String {
        d.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn md2(s: &str) -> String {
        let mut h = Md2::default();
        h.update(s.as_bytes());
        hex(h.finish())
    }

    #[test]
    fn md2_matches_rfc_1319() {
        assert_eq!(md2(""), "8350e5a3e24c153df2275c9f80692773");
        assert_eq!(md2("a"), "32ec01ec4a6dac72c0ab96fb34c0b5d1");
        assert_eq!(md2("abc"), "da853b0d3f88d99b30283a69e6ded6bb");
        assert_eq!(md2("message digest"), "ab4f496bfb2a530b219ff33031fe06b0");
        assert_eq!(
            md2("12345678901234567890123456789012345678901234567890123456789012345678901234567890"),
            "d5976f79d83d3a0dc9806c3c66f3efd8"
        );
    }

    #[test]
    fn the_keyed_state_matches_the_published_intermediate() {
        // The state after hashing KEY ^ 0x36, as published with the reverse engineering.
        let (x, c) = keyed(0x36).state();
        assert_eq!(hex(x), "8b219a49e86d1aeef237f9b54a8c3c75");
        assert_eq!(hex(c), "57a110860e60441e705f67d1eb67a13d");
    }

    #[test]
    fn old_versions_get_constants_and_inputs_change_the_token() {
        let mut i = Inputs {
            version: 12080,
            unix_seconds: 1,
            driver_version: 13000,
            process: 2,
            thread: 3,
            cudart_table: 4,
            integrity_table: 5,
            function: 6,
            devices: vec![],
        };
        assert_eq!(token(&i), [0x3341181C03CB675C, 0x8ED383AA1F4CD1E8]);
        i.version = 13002;
        let a = token(&i);
        i.devices.push(DeviceId {
            uuid: [1; 16],
            pci_domain: 0,
            pci_bus: 2,
            pci_device: 0,
        });
        assert_ne!(a, token(&i));
    }
}
