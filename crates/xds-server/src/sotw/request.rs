//! What a state-of-the-world request asks for: its subscription ([`Subscription`]), and
//! the request as read off the wire ([`WireRequest`]: its resource names in one string,
//! checked to be UTF-8 and bounded before anything else reads them).

use std::sync::Arc;

use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;

use crate::names::SharedNames;

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Subscription {
    Wildcard,
    /// Shared with every stream whose client listed the same names.
    Names(Arc<SharedNames>),
}

impl Subscription {
    /// The subscription a request's `resource_names` (`listed`) asks for. Empty is a
    /// wildcard only while the client has never named a resource of the type on this
    /// stream (the legacy form); after that it unsubscribes from everything.
    pub(super) fn from_names(listed: &Arc<SharedNames>, named_before: bool) -> Subscription {
        let names = listed.list();
        if names.iter().any(|n| &**n == "*") || (names.is_empty() && !named_before) {
            Subscription::Wildcard
        } else {
            Subscription::Names(listed.clone())
        }
    }

    pub(super) fn wants(&self, name: &str) -> bool {
        match self {
            Subscription::Wildcard => true,
            Subscription::Names(names) => names.contains(name),
        }
    }
}

/// A `DiscoveryRequest` as read off the wire: its resource names are kept one after
/// another in one string instead of a `String` each. Every ACK of an Envoy repeats its
/// whole subscription (200 endpoint names here), and allocating, checking, hashing and
/// freeing them one by one was the largest part of a state-of-the-world stream's work
/// per push.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WireRequest {
    /// The request, but for `resource_names` (left empty).
    pub request: DiscoveryRequest,
    /// The resource names, one after another: bytes while decoding, then checked UTF-8.
    raw: Vec<u8>,
    text: String,
    /// Where each name ends in `text`.
    ends: Vec<u32>,
}

impl WireRequest {
    /// The resource names, in the request's order.
    pub(crate) fn resource_names(&self) -> impl Iterator<Item = &str> + '_ {
        let starts = std::iter::once(0).chain(self.ends.iter().copied());
        starts.zip(self.ends.iter().copied()).map(|(start, end)| {
            self.text
                .get(start as usize..end as usize)
                .unwrap_or_default()
        })
    }

    /// Checks that every name is UTF-8 (as prost does for a `string`), all at once.
    pub(super) fn check_names(&mut self) -> Result<(), prost::DecodeError> {
        match String::from_utf8(std::mem::take(&mut self.raw)) {
            // Each name is UTF-8 when all are, and each starts and ends on a character.
            Ok(text) if self.ends.iter().all(|e| text.is_char_boundary(*e as usize)) => {
                self.text = text;
                Ok(())
            }
            Ok(text) => Err(self.first_not_utf8(text.as_bytes())),
            Err(e) => Err(self.first_not_utf8(e.as_bytes())),
        }
    }

    /// The error for the first of the names in `raw` that is not UTF-8.
    pub(super) fn first_not_utf8(&self, raw: &[u8]) -> prost::DecodeError {
        let mut start = 0;
        for end in &self.ends {
            let name = &raw[start..*end as usize];
            if std::str::from_utf8(name).is_err() {
                return not_utf8(name);
            }
            start = *end as usize;
        }
        not_utf8(raw)
    }
}

/// The error prost gives a `string` field of a `DiscoveryRequest` that is not UTF-8.
fn not_utf8(name: &[u8]) -> prost::DecodeError {
    let mut field = Vec::new();
    prost::encoding::encode_varint(name.len() as u64, &mut field);
    field.extend_from_slice(name);
    let wire_type = prost::encoding::WireType::LengthDelimited;
    let ctx = prost::encoding::DecodeContext::default();
    let mut e =
        match prost::encoding::string::merge(wire_type, &mut String::new(), &mut &field[..], ctx) {
            Err(e) => e,
            #[allow(deprecated)] // (never: `name` is not UTF-8)
            Ok(()) => prost::DecodeError::new("invalid string value: data is not UTF-8 encoded"),
        };
    e.push("DiscoveryRequest", "resource_names");
    e
}

impl From<DiscoveryRequest> for WireRequest {
    fn from(mut request: DiscoveryRequest) -> WireRequest {
        let names = std::mem::take(&mut request.resource_names);
        let mut wire = WireRequest {
            request,
            ..Default::default()
        };
        for name in names {
            wire.text.push_str(&name);
            wire.ends.push(wire.text.len() as u32);
        }
        wire
    }
}

/// `resource_names` is field 3 of `DiscoveryRequest`.
const RESOURCE_NAMES_TAG: u32 = 3;

impl prost::Message for WireRequest {
    fn encode_raw(&self, buf: &mut impl bytes::BufMut) {
        use prost::encoding::{encode_key, encode_varint, WireType};
        self.request.encode_raw(buf);
        for name in self.resource_names() {
            encode_key(RESOURCE_NAMES_TAG, WireType::LengthDelimited, buf);
            encode_varint(name.len() as u64, buf);
            buf.put_slice(name.as_bytes());
        }
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: prost::encoding::WireType,
        buf: &mut impl bytes::Buf,
        ctx: prost::encoding::DecodeContext,
    ) -> Result<(), prost::DecodeError> {
        use prost::encoding::{check_wire_type, decode_varint, WireType};
        if tag != RESOURCE_NAMES_TAG {
            return self.request.merge_field(tag, wire_type, buf, ctx);
        }
        let in_field = |mut e: prost::DecodeError| {
            e.push("DiscoveryRequest", "resource_names");
            e
        };
        check_wire_type(WireType::LengthDelimited, wire_type).map_err(in_field)?;
        let len = decode_varint(buf).map_err(in_field)?;
        if len > buf.remaining() as u64 {
            #[allow(deprecated)] // prost's own words for it, as its `string` decoder says
            return Err(in_field(prost::DecodeError::new("buffer underflow")));
        }
        // After a `decode`, names from a later `merge` are bytes again until checked.
        if !self.text.is_empty() && self.raw.is_empty() {
            self.raw = std::mem::take(&mut self.text).into_bytes();
        }
        let mut left = len as usize;
        while left > 0 {
            let chunk = buf.chunk();
            let n = chunk.len().min(left);
            self.raw.extend_from_slice(&chunk[..n]);
            buf.advance(n);
            left -= n;
        }
        self.ends.push(self.raw.len() as u32);
        Ok(())
    }

    fn encoded_len(&self) -> usize {
        use prost::encoding::{encoded_len_varint, key_len};
        self.request.encoded_len()
            + self
                .resource_names()
                .map(|n| key_len(RESOURCE_NAMES_TAG) + encoded_len_varint(n.len() as u64) + n.len())
                .sum::<usize>()
    }

    fn clear(&mut self) {
        self.request.clear();
        self.raw.clear();
        self.text.clear();
        self.ends.clear();
    }

    fn decode(buf: impl bytes::Buf) -> Result<WireRequest, prost::DecodeError> {
        let mut request = WireRequest::default();
        // Room for every name at once (most of an ACK is names, of about 20 bytes each).
        request.raw.reserve(buf.remaining());
        request.ends.reserve(buf.remaining() / 16);
        request.merge(buf)?;
        request.check_names()?;
        Ok(request)
    }
}
