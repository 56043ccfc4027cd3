//! ferry's WAN transport ("Streams" in XvMotion). It carries opaque frames and never looks
//! inside them.
//!
//! Layout (growing with issue 3):
//! - [`buffers`]: socket buffers sized to the link, at both ends.
//! - [`connection_count`]: how many connections a session keeps to its peer.
//! - [`frame`]: the frame format on the wire, with an incremental decoder that caps every
//!   length a peer controls.
//! - [`outbox`]: the sender's side of a channel: numbering, a byte-bounded buffer of
//!   unacknowledged frames (backpressure), and replay after a reconnect.
//! - [`reorder`]: per-channel in-order delivery of frames that arrive out of order or twice
//!   (several TCP connections, replay after a reconnect).

pub mod buffers;
pub mod connection_count;
pub mod frame;
pub mod net;
pub mod outbox;
pub mod reorder;
pub mod session;
pub mod tls;

pub use frame::{ChannelId, Frame, FrameError, FrameKind, Seq};
pub use outbox::{Outbox, OutboxError, MAX_SEND_WINDOW_BYTES, MAX_UNACKED_FRAMES};
pub use reorder::{Reorder, ReorderError};
pub use session::{
    ConnectionEnd, Received, Session, SessionConfig, SessionError, SessionId, SessionStats,
};
