//! Counting RESP frames in a byte stream as it passes, in any pieces: the requests a
//! connection wrote, and the replies it read. The difference is what Redis owes.
//!
//! Only the framing is read: a type byte, a line, and for bulk strings a length of bytes
//! to skip. Aggregates (arrays, and RESP3's maps, sets and pushes) count as one frame
//! once their last element has come. A byte that starts no known type stops the count
//! for good ([`Frames::is_lost`]): the watch then declares nothing on that connection.

use smallvec::SmallVec;

/// Where the counter is in the stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum At {
    /// The next byte is a type.
    Type,
    /// Inside a line of `kind` (its number so far, and whether a `-` came first).
    Line {
        kind: u8,
        number: u64,
        negative: bool,
    },
    /// The line's `\r` came: its `\n` next.
    LineEnd {
        kind: u8,
        number: u64,
        negative: bool,
    },
    /// Bytes of a bulk string left, its `\r\n` included.
    Bulk(u64),
    /// A byte that starts no known type came.
    Lost,
}

/// A streaming count of complete top-level RESP frames.
#[derive(Debug)]
pub(super) struct Frames {
    at: At,
    /// Elements left in each open aggregate, outermost first.
    open: SmallVec<[u64; 4]>,
    complete: u64,
}

impl Frames {
    pub(super) fn new() -> Self {
        Frames {
            at: At::Type,
            open: SmallVec::new(),
            complete: 0,
        }
    }

    /// Complete frames so far.
    pub(super) fn complete(&self) -> u64 {
        self.complete
    }

    /// Whether a byte came that starts no known type: the count means nothing since.
    pub(super) fn is_lost(&self) -> bool {
        self.at == At::Lost
    }

    /// One element ended: it completes a top-level frame, or counts down its aggregate
    /// (which may end in turn).
    fn ended(&mut self) {
        loop {
            let Some(left) = self.open.last_mut() else {
                self.complete += 1;
                return;
            };
            *left -= 1;
            if *left > 0 {
                return;
            }
            self.open.pop();
        }
    }

    /// A line of `kind` with `number` (negative when `negative`) ended.
    fn line(&mut self, kind: u8, number: u64, negative: bool) {
        match kind {
            // A bulk string of `number` bytes; -1: null.
            b'$' | b'!' | b'=' => {
                if negative {
                    self.ended();
                } else {
                    self.at = At::Bulk(number.saturating_add(2));
                    return;
                }
            }
            // An aggregate of `number` elements (a map's are pairs); 0 or -1: done.
            b'*' | b'~' | b'>' | b'%' => {
                let elements = if kind == b'%' {
                    number.saturating_mul(2)
                } else {
                    number
                };
                if negative || elements == 0 {
                    self.ended();
                } else {
                    self.open.push(elements);
                }
            }
            // A simple string, error, integer, null, boolean, double or big number.
            _ => self.ended(),
        }
        self.at = At::Type;
    }

    /// Counts the frames that `bytes`, the next of the stream, complete.
    pub(super) fn feed(&mut self, mut bytes: &[u8]) {
        while let Some((&byte, rest)) = bytes.split_first() {
            match self.at {
                At::Lost => return,
                At::Type => {
                    self.at = match byte {
                        b'+' | b'-' | b':' | b'$' | b'*' | b'_' | b',' | b'#' | b'(' | b'!'
                        | b'=' | b'%' | b'~' | b'>' => At::Line {
                            kind: byte,
                            number: 0,
                            negative: false,
                        },
                        _ => At::Lost,
                    };
                    bytes = rest;
                }
                At::Line {
                    kind,
                    number,
                    negative,
                } => {
                    // Only a length or count line's digits matter; any other line is
                    // skipped to its end.
                    let counted = matches!(kind, b'$' | b'!' | b'=' | b'*' | b'~' | b'>' | b'%');
                    self.at = match byte {
                        b'\r' => At::LineEnd {
                            kind,
                            number,
                            negative,
                        },
                        b'-' if counted && number == 0 => At::Line {
                            kind,
                            number,
                            negative: true,
                        },
                        b'0'..=b'9' if counted => At::Line {
                            kind,
                            number: number
                                .saturating_mul(10)
                                .saturating_add(u64::from(byte - b'0')),
                            negative,
                        },
                        _ if counted => At::Lost,
                        _ => At::Line {
                            kind,
                            number,
                            negative,
                        },
                    };
                    bytes = rest;
                }
                At::LineEnd {
                    kind,
                    number,
                    negative,
                } => {
                    if byte != b'\n' {
                        self.at = At::Lost;
                        return;
                    }
                    bytes = rest;
                    self.line(kind, number, negative);
                }
                At::Bulk(left) => {
                    let take = usize::try_from(left).unwrap_or(usize::MAX).min(bytes.len());
                    bytes = &bytes[take..];
                    let left = left - take as u64;
                    if left == 0 {
                        self.at = At::Type;
                        self.ended();
                    } else {
                        self.at = At::Bulk(left);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The frames `stream` completes, fed whole and fed a byte at a time.
    fn count(stream: &[u8]) -> (u64, u64) {
        let mut whole = Frames::new();
        whole.feed(stream);
        let mut bytes = Frames::new();
        for b in stream {
            bytes.feed(std::slice::from_ref(b));
        }
        assert_eq!(whole.is_lost(), bytes.is_lost());
        (whole.complete(), bytes.complete())
    }

    #[test]
    fn requests_and_replies_are_counted_in_any_pieces() {
        // An EVALSHA request, then a script's reply (an array of integers), a NOSCRIPT
        // error, a null bulk, an empty array, a nested array and a bulk with \r\n inside.
        let stream = b"*3\r\n$7\r\nEVALSHA\r\n$2\r\nab\r\n$1\r\n0\r\n\
            *4\r\n:0\r\n:99\r\n:-1\r\n:0\r\n\
            -NOSCRIPT No matching script\r\n\
            $-1\r\n*0\r\n\
            *2\r\n*2\r\n:1\r\n$3\r\nabc\r\n+OK\r\n\
            $4\r\na\r\nb\r\n";
        assert_eq!(count(stream), (7, 7));
        // Half a frame is not one.
        assert_eq!(count(b"*2\r\n:1\r\n"), (0, 0));
        assert_eq!(count(b"$5\r\nabc"), (0, 0));
        // RESP3: a map of one pair, a null, a boolean.
        assert_eq!(count(b"%1\r\n+a\r\n:1\r\n_\r\n#t\r\n"), (3, 3));
    }

    #[test]
    fn a_stream_that_is_not_resp_is_lost_for_good() {
        let mut frames = Frames::new();
        frames.feed(b"+OK\r\nHTTP/1.1 200 OK\r\n+OK\r\n");
        assert!(frames.is_lost());
        assert_eq!(frames.complete(), 1);
        let mut frames = Frames::new();
        frames.feed(b"$x\r\n");
        assert!(frames.is_lost());
    }
}
