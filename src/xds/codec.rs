//! gRPC framing for the ADS streams, without tonic's codec: each response is framed into
//! its own buffer (5-byte header and the message) and freed once written, and requests
//! are read from the body by [`RequestStream`], whose buffer is released between
//! messages.
//!
//! Why: tonic's codec keeps, per stream, an encode buffer at the capacity of the largest
//! response it ever sent and a decode buffer at the largest request chunk, for the life
//! of the stream; with thousands of idle Envoys that was most of the server's memory.
//!
//! Invariants: a request over the size limit is refused from its header, before it is
//! buffered; compressed requests are refused.

use bytes::{BufMut, Bytes, BytesMut};
use http_body_util::BodyExt;
use tonic::Status;

/// A request buffer larger than this is dropped once it is empty.
const KEEP_REQUEST_BUFFER_BYTES: usize = 1024;

/// One gRPC message, framed: compression flag 0, big-endian length, the message.
pub fn frame<M: prost::Message>(message: &M) -> Bytes {
    let len = message.encoded_len();
    let mut buf = BytesMut::with_capacity(5 + len);
    buf.put_u8(0);
    buf.put_u32(len as u32);
    // Cannot fail: the buffer has room for `encoded_len` bytes.
    let _ = message.encode(&mut buf);
    buf.freeze()
}

/// The messages of a gRPC request body.
pub struct RequestStream<T> {
    body: tonic::body::Body,
    buf: BytesMut,
    max_message_bytes: usize,
    _message: std::marker::PhantomData<fn() -> T>,
}

impl<T: prost::Message + Default> RequestStream<T> {
    pub fn new(body: tonic::body::Body, max_message_bytes: usize) -> RequestStream<T> {
        RequestStream {
            body,
            buf: BytesMut::new(),
            max_message_bytes,
            _message: std::marker::PhantomData,
        }
    }

    /// The next message; `Ok(None)` when the client ended the stream.
    pub async fn message(&mut self) -> Result<Option<T>, Status> {
        loop {
            if let Some(message) = self.decode_buffered()? {
                return Ok(Some(message));
            }
            match self.body.frame().await {
                None if self.buf.is_empty() => return Ok(None),
                None => return Err(Status::internal("the stream ended inside a message")),
                Some(Err(status)) => return Err(status),
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.buf.extend_from_slice(&data);
                    }
                }
            }
        }
    }

    fn decode_buffered(&mut self) -> Result<Option<T>, Status> {
        if self.buf.len() < 5 {
            return Ok(None);
        }
        if self.buf[0] != 0 {
            return Err(Status::unimplemented(
                "compressed xDS requests are not supported",
            ));
        }
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        if len > self.max_message_bytes {
            return Err(Status::out_of_range(format!(
                "a request of {len} bytes is over the limit of {} bytes",
                self.max_message_bytes
            )));
        }
        if self.buf.len() < 5 + len {
            self.buf.reserve(5 + len - self.buf.len());
            return Ok(None);
        }
        let mut message = self.buf.split_to(5 + len);
        let message = message.split_off(5).freeze();
        if self.buf.is_empty() && self.buf.capacity() > KEEP_REQUEST_BUFFER_BYTES {
            self.buf = BytesMut::new();
        }
        T::decode(message)
            .map(Some)
            .map_err(|e| Status::internal(format!("undecodable request: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
    use http_body::Frame;

    fn stream(chunks: Vec<Vec<u8>>, max: usize) -> RequestStream<DiscoveryRequest> {
        let frames = chunks
            .into_iter()
            .map(|c| Ok::<_, Status>(Frame::data(Bytes::from(c))));
        let body = http_body_util::StreamBody::new(futures::stream::iter(frames));
        RequestStream {
            body: tonic::body::Body::new(body),
            buf: BytesMut::new(),
            max_message_bytes: max,
            _message: std::marker::PhantomData,
        }
    }

    fn request(type_url: &str) -> DiscoveryRequest {
        DiscoveryRequest {
            type_url: type_url.into(),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn reads_messages_across_and_within_chunks() {
        let mut bytes = frame(&request("a")).to_vec();
        bytes.extend_from_slice(&frame(&request("b")));
        bytes.extend_from_slice(&frame(&request("c")));
        let (first, rest) = bytes.split_at(3);
        let (second, third) = rest.split_at(20);
        let mut s = stream(vec![first.to_vec(), second.to_vec(), third.to_vec()], 1024);
        for want in ["a", "b", "c"] {
            assert_eq!(s.message().await.unwrap().unwrap().type_url, want);
        }
        assert!(s.message().await.unwrap().is_none());

        // A large request does not leave a large buffer behind.
        let big = frame(&DiscoveryRequest {
            resource_names: (0..200)
                .map(|i| format!("default/service-{i}/cluster"))
                .collect(),
            ..Default::default()
        });
        let mut s = stream(vec![big[..4000].to_vec(), big[4000..].to_vec()], 1 << 20);
        assert_eq!(
            s.message().await.unwrap().unwrap().resource_names.len(),
            200
        );
        assert!(
            s.buf.capacity() <= KEEP_REQUEST_BUFFER_BYTES,
            "{}",
            s.buf.capacity()
        );
    }

    #[tokio::test]
    async fn refuses_oversized_compressed_truncated_and_garbage() {
        let big = frame(&DiscoveryRequest {
            resource_names: vec!["x".repeat(100)],
            ..Default::default()
        });
        // Refused from the header alone: only the first 5 bytes are sent.
        let err = stream(vec![big[..5].to_vec()], 50)
            .message()
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::OutOfRange);

        let mut compressed = frame(&request("a")).to_vec();
        compressed[0] = 1;
        let err = stream(vec![compressed], 1024).message().await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unimplemented);

        let whole = frame(&request("abc"));
        let err = stream(vec![whole[..whole.len() - 1].to_vec()], 1024)
            .message()
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::Internal);

        // Field 2 (node, a message) with a fixed64 wire type.
        let garbage = vec![0, 0, 0, 0, 9, 0x11, 1, 2, 3, 4, 5, 6, 7, 8];
        let err = stream(vec![garbage], 1024).message().await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::Internal);
    }
}
