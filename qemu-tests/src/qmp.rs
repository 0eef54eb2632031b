//! A small QMP client over the guest's Unix socket: capabilities negotiation, commands,
//! and the asynchronous events that arrive between replies.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// Why a QMP exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    /// The socket could not be reached in time.
    #[error("connecting to {0}")]
    Connect(String, #[source] std::io::Error),
    /// Reading or writing the socket failed.
    #[error("QMP socket i/o")]
    Io(#[from] std::io::Error),
    /// A line was not JSON.
    #[error("QMP sent something that is not JSON: {0}")]
    Json(String),
    /// QEMU answered with an error.
    #[error("QMP {command} failed: {error}")]
    Command {
        /// The command.
        command: String,
        /// QEMU's error object.
        error: Value,
    },
    /// QEMU closed the socket.
    #[error("QEMU closed the QMP socket")]
    Closed,
}

/// A negotiated QMP connection.
#[derive(Debug)]
pub struct Qmp {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
    /// Events received so far, in order.
    pub events: Vec<Value>,
}

impl Qmp {
    /// Connects (retrying until `wait` passes: QEMU creates the socket as it starts) and
    /// leaves capabilities negotiation mode.
    pub fn connect(path: &Path, wait: Duration) -> Result<Self, QmpError> {
        let deadline = Instant::now() + wait;
        let stream = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e) if Instant::now() >= deadline => return Err(QmpError::Connect(path.display().to_string(), e)),
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        stream.set_read_timeout(Some(Duration::from_secs(60)))?;
        let writer = stream.try_clone()?;
        let mut qmp = Qmp { reader: BufReader::new(stream), writer, events: Vec::new() };
        let greeting = qmp.read()?;
        if greeting.get("QMP").is_none() {
            return Err(QmpError::Json(greeting.to_string()));
        }
        qmp.execute("qmp_capabilities", json!({}))?;
        Ok(qmp)
    }

    fn read(&mut self) -> Result<Value, QmpError> {
        let mut line = String::new();
        if self.reader.read_line(&mut line)? == 0 {
            return Err(QmpError::Closed);
        }
        serde_json::from_str(&line).map_err(|_| QmpError::Json(line.trim().to_owned()))
    }

    /// Runs `command` with `arguments`; returns its `return` value. Events that arrive
    /// before the reply are kept in [`Qmp::events`].
    pub fn execute(&mut self, command: &str, arguments: Value) -> Result<Value, QmpError> {
        let msg = json!({ "execute": command, "arguments": arguments });
        self.writer.write_all(format!("{msg}\n").as_bytes())?;
        loop {
            let v = self.read()?;
            if v.get("event").is_some() {
                self.events.push(v);
                continue;
            }
            if let Some(r) = v.get("return") {
                return Ok(r.clone());
            }
            if let Some(e) = v.get("error") {
                return Err(QmpError::Command { command: command.to_owned(), error: e.clone() });
            }
        }
    }

    /// Waits up to `wait` for an event named `name` (already received or arriving).
    pub fn wait_event(&mut self, name: &str, wait: Duration) -> Result<Option<Value>, QmpError> {
        if let Some(e) = self.events.iter().find(|e| e["event"] == name) {
            return Ok(Some(e.clone()));
        }
        let deadline = Instant::now() + wait;
        while Instant::now() < deadline {
            let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(10));
            self.reader.get_ref().set_read_timeout(Some(left))?;
            match self.read() {
                Ok(v) => {
                    let hit = v["event"] == name;
                    if v.get("event").is_some() {
                        self.events.push(v.clone());
                    }
                    if hit {
                        return Ok(Some(v));
                    }
                }
                Err(QmpError::Io(e))
                    if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) =>
                {
                    break;
                }
                // QEMU exits when the guest powers off: no more events will come.
                Err(QmpError::Closed) => break,
                Err(e) => return Err(e),
            }
        }
        Ok(None)
    }
}
