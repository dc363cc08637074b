//! gRPC on the wire as Ray's proxy puts it there: the `grpc-timeout` header read, each
//! method's framing (unary or streaming) the way Ray frames it, trailers-only statuses,
//! and `grpc-message` percent-encoded.
//!
//! Invariant: what leaves here is byte-for-byte what Ray's proxy sends for the same
//! case (the captures and `proto/ray-serve-grpc-research.md` say what that is).

use super::*;

/// A `grpc-timeout` header's value (at most 8 digits and a unit), if there is a valid one.
pub(super) fn grpc_timeout(headers: &axum::http::HeaderMap) -> Option<Duration> {
    let value = headers.get("grpc-timeout")?.to_str().ok()?;
    let digits = value.get(..value.len().checked_sub(1)?)?;
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match &value[digits.len()..] {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// The kind of a method the server has, which decides how its errors are framed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum MethodKind {
    /// `Healthz`, `ListApplications`, `Say`.
    Unary,
    /// `SayMany` (server streaming), `Chat` (bidirectional).
    Streaming,
}

impl MethodKind {
    /// `None`: no servicer has the method.
    pub(super) fn of(path: &str) -> Option<MethodKind> {
        match path {
            HEALTHZ_PATH | LIST_APPLICATIONS_PATH | SAY_PATH => Some(MethodKind::Unary),
            SAY_MANY_PATH | CHAT_PATH => Some(MethodKind::Streaming),
            _ => None,
        }
    }
}

/// An empty gRPC message: not compressed, 0 bytes long.
pub(super) const EMPTY_MESSAGE: [u8; 5] = [0; 5];

/// Frames an answer of Ray's proxy (or replica) to a method of `kind` at `path` as Ray 2.60
/// does (grpcio's aio server). A trailers-only error (tonic's way) of a unary method becomes
/// response headers, the empty message and trailers with its status; a streaming method's
/// stays trailers-only. Every other answer gets Ray's `grpc-accept-encoding` header and a
/// `grpc-message` in its trailers: `success` on an `OK` of Ray's own API, else empty if it
/// had none. Every `grpc-message` is percent-encoded as grpc core encodes it.
pub(super) fn frame_like_ray(
    kind: MethodKind,
    path: &str,
    response: Response<tonic::body::Body>,
) -> Response<tonic::body::Body> {
    use axum::body::Bytes;
    use axum::http::{HeaderMap, HeaderName, HeaderValue};
    use http_body_util::BodyExt;
    use hyper::body::Frame;

    let (mut parts, body) = response.into_parts();
    let trailers_only = parts.headers.contains_key(Status::GRPC_STATUS);
    encode_grpc_message(&mut parts.headers);
    if trailers_only && kind == MethodKind::Streaming {
        return Response::from_parts(parts, body);
    }
    parts.headers.insert(
        HeaderName::from_static("grpc-accept-encoding"),
        HeaderValue::from_static(GRPC_ACCEPT_ENCODING),
    );
    if trailers_only {
        let mut trailers = HeaderMap::new();
        for name in [
            Status::GRPC_STATUS,
            Status::GRPC_MESSAGE,
            Status::GRPC_STATUS_DETAILS,
        ] {
            if let Some(value) = parts.headers.remove(&name) {
                trailers.insert(name, value);
            }
        }
        trailers
            .entry(Status::GRPC_MESSAGE)
            .or_insert(HeaderValue::from_static(""));
        let frames = [
            Frame::data(Bytes::from_static(&EMPTY_MESSAGE)),
            Frame::trailers(trailers),
        ]
        .map(Ok::<_, std::convert::Infallible>);
        let body = http_body_util::StreamBody::new(futures_util::stream::iter(frames));
        return Response::from_parts(parts, tonic::body::Body::new(body));
    }
    let ok_message = if matches!(path, HEALTHZ_PATH | LIST_APPLICATIONS_PATH) {
        HEALTHY_MESSAGE
    } else {
        ""
    };
    let body = body.map_frame(move |frame| match frame.into_trailers() {
        Ok(mut trailers) => {
            let ok = trailers
                .get(Status::GRPC_STATUS)
                .is_some_and(|code| code == "0");
            trailers
                .entry(Status::GRPC_MESSAGE)
                .or_insert(HeaderValue::from_static(if ok { ok_message } else { "" }));
            encode_grpc_message(&mut trailers);
            Frame::trailers(trailers)
        }
        Err(frame) => frame,
    });
    Response::from_parts(parts, tonic::body::Body::new(body))
}

/// A trailers-only error response, as tonic (and grpc core) send errors; [`frame_like_ray`]
/// reframes those of unary methods.
pub(super) fn status(code: Code, message: &str) -> Response<tonic::body::Body> {
    let mut response: Response<tonic::body::Body> = Status::new(code, message).into_http();
    encode_grpc_message(response.headers_mut());
    response
}

/// Re-encodes a `grpc-message` in `headers` as grpc core does, the gRPC spec's minimum:
/// only bytes outside `0x20..=0x7E`, and `%`, percent-encoded (tonic also encodes spaces
/// and some punctuation; Ray's messages show them as they are).
pub(super) fn encode_grpc_message(headers: &mut axum::http::HeaderMap) {
    use std::fmt::Write;

    let Some(value) = headers.get(Status::GRPC_MESSAGE) else {
        return;
    };
    let raw = value.as_bytes();
    let hex = |at: usize| raw.get(at).and_then(|b| char::from(*b).to_digit(16));
    let mut decoded = Vec::with_capacity(raw.len());
    let mut at = 0;
    while at < raw.len() {
        match (raw[at], hex(at + 1), hex(at + 2)) {
            (b'%', Some(high), Some(low)) => {
                decoded.push(u8::try_from(high * 16 + low).unwrap_or(b'?'));
                at += 3;
            }
            (byte, _, _) => {
                decoded.push(byte);
                at += 1;
            }
        }
    }
    let mut encoded = String::with_capacity(decoded.len());
    for byte in decoded {
        if (0x20..=0x7e).contains(&byte) && byte != b'%' {
            encoded.push(char::from(byte));
        } else {
            let _ = write!(encoded, "%{byte:02X}");
        }
    }
    if let Ok(value) = axum::http::HeaderValue::from_str(&encoded) {
        headers.insert(Status::GRPC_MESSAGE, value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_messages_are_encoded_as_grpc_core_encodes_them() {
        let text = "Application 'c' not found. 100% \u{1b}[36m\né?{}";
        let mut headers = Status::not_found(text).into_http::<()>().headers().clone();
        assert_ne!(headers[Status::GRPC_MESSAGE], text, "tonic encodes more");
        encode_grpc_message(&mut headers);
        assert_eq!(
            headers[Status::GRPC_MESSAGE],
            "Application 'c' not found. 100%25 %1B[36m%0A%C3%A9?{}"
        );
        assert_eq!(Status::from_header_map(&headers).unwrap().message(), text);
    }

    #[test]
    fn grpc_timeouts_are_read_as_the_spec_writes_them() {
        let timeout = |value: &str| {
            let mut headers = axum::http::HeaderMap::new();
            headers.insert("grpc-timeout", value.parse().unwrap());
            grpc_timeout(&headers)
        };
        assert_eq!(timeout("500m"), Some(Duration::from_millis(500)));
        assert_eq!(timeout("2S"), Some(Duration::from_secs(2)));
        assert_eq!(timeout("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(timeout("7u"), Some(Duration::from_micros(7)));
        assert_eq!(timeout("99999999n"), Some(Duration::from_nanos(99_999_999)));
        for bad in ["", "m", "123456789m", "5x", "-5m", "5 m"] {
            assert_eq!(timeout(bad), None, "{bad:?}");
        }
    }
}
