//! A prefill rank's push bookkeeping in vLLM's protocol, as plain state `push_vllm.rs`
//! drives: the requests held for push, and the `PUSH_REG:` registrations that came before
//! them (bounded in count and bytes, dropped after a time, the oldest first).
//!
//! vLLM's registrations carry no proof: a registration matches a held request by its exact
//! id, else by the id without vLLM's random suffix on both sides (`base_id`), the first
//! match winning, as vLLM's prefill matches them. One registration of a request is being
//! written at a time; others wait as early ones do, for the one started to be given up.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use crate::vllm::push_reg::{base_id, PushRegistration};
use crate::worker::push_book::{HeldBlocks, PrefillPushStats, MAX_WAITING, MAX_WAITING_BYTES};

/// A request held for push: its blocks in token order, and how many each KV cache group
/// has (empty: one group).
#[derive(Debug, Clone)]
struct Held {
    blocks: HeldBlocks,
    /// A registration was matched: a WRITE is or was under way.
    started: bool,
}

/// A registration that came before its request was held.
#[derive(Debug)]
struct Early {
    sender: Vec<u8>,
    registration: PushRegistration,
    bytes: usize,
    arrived: Instant,
}

/// A WRITE to start: `ready`'s blocks of held request `request_id` into the blocks
/// `registration` (from agent `sender`) names.
#[derive(Debug)]
pub(crate) struct VllmWrite {
    pub(crate) request_id: String,
    pub(crate) sender: Vec<u8>,
    pub(crate) registration: Box<PushRegistration>,
    /// The held request's blocks.
    pub(crate) ready: HeldBlocks,
}

/// A prefill rank's vLLM push book.
#[derive(Debug)]
pub(crate) struct VllmPrefillBook {
    held: HashMap<String, Held>,
    early: VecDeque<Early>,
    early_bytes: usize,
    /// How long an early registration may wait.
    ttl: Duration,
    pub(crate) stats: PrefillPushStats,
}

impl VllmPrefillBook {
    /// A book whose early registrations wait at most `ttl`.
    pub(crate) fn new(ttl: Duration) -> Self {
        VllmPrefillBook {
            held: HashMap::new(),
            early: VecDeque::new(),
            early_bytes: 0,
            ttl,
            stats: PrefillPushStats::default(),
        }
    }

    /// `request_id`'s blocks are held for push; the first early registration that matches
    /// it (exact id first, then base id, in arrival order) is written.
    pub(crate) fn ready(&mut self, request_id: &str, blocks: HeldBlocks) -> Option<VllmWrite> {
        if self.held.contains_key(request_id) {
            return None;
        }
        let held = Held {
            blocks,
            started: false,
        };
        self.held.insert(request_id.to_string(), held);
        self.take_early(request_id)
    }

    /// Starts held `request_id` for the first early registration that matches it (exact
    /// id first, then base id, in arrival order), if any.
    fn take_early(&mut self, request_id: &str) -> Option<VllmWrite> {
        let base = base_id(request_id);
        let at = self
            .early
            .iter()
            .position(|e| e.registration.request_id == request_id)
            .or_else(|| {
                self.early
                    .iter()
                    .position(|e| base_id(&e.registration.request_id) == base)
            })?;
        let early = self.early.remove(at)?;
        self.early_bytes -= early.bytes;
        self.stats.waited += 1;
        self.start(request_id, early.sender, early.registration)
    }

    /// A registration from agent `sender`: written if it matches a held request not yet
    /// started, else kept (bounded) until one is held or the one started is given up (see
    /// [`unstart`](Self::unstart)).
    pub(crate) fn registration(
        &mut self,
        sender: &[u8],
        registration: PushRegistration,
        bytes: usize,
    ) -> Option<VllmWrite> {
        let id = registration.request_id.as_str();
        let base = base_id(id);
        let open = |k: &str| self.held.get(k).is_some_and(|h| !h.started);
        // Exact id first; then the base id, among held requests not written yet (a
        // HashMap keeps no arrival order: the least id of them).
        let matched = match open(id) {
            true => Some(id.to_string()),
            false => self
                .held
                .keys()
                .filter(|k| open(k) && base_id(k) == base)
                .min()
                .cloned(),
        };
        if let Some(request_id) = matched {
            return self.start(&request_id, sender.to_vec(), registration);
        }
        self.wait(sender, registration, bytes);
        None
    }

    fn start(
        &mut self,
        request_id: &str,
        sender: Vec<u8>,
        registration: PushRegistration,
    ) -> Option<VllmWrite> {
        let held = self.held.get_mut(request_id).filter(|h| !h.started)?;
        held.started = true;
        self.stats.matched += 1;
        Some(VllmWrite {
            request_id: request_id.to_string(),
            sender,
            registration: Box::new(registration),
            ready: held.blocks.clone(),
        })
    }

    /// The registration matched to `request_id` was given up before any WRITE was posted
    /// (its sender is not the decode rank it names, or the handshake failed): the first
    /// other registration kept for it, if any, is started now; else a later one may match.
    pub(crate) fn unstart(&mut self, request_id: &str) -> Option<VllmWrite> {
        self.held.get_mut(request_id)?.started = false;
        self.take_early(request_id)
    }

    /// `request_id` was released (written, or its lease ended).
    pub(crate) fn released(&mut self, request_id: &str) {
        self.held.remove(request_id);
    }

    /// Drops early registrations older than the book's time; how many it dropped.
    pub(crate) fn expire(&mut self, now: Instant) -> u64 {
        let mut dropped = 0;
        while self
            .early
            .front()
            .is_some_and(|e| now.saturating_duration_since(e.arrived) >= self.ttl)
        {
            self.drop_oldest();
            dropped += 1;
        }
        self.stats.evicted += dropped;
        dropped
    }

    fn wait(&mut self, sender: &[u8], registration: PushRegistration, bytes: usize) {
        if bytes > MAX_WAITING_BYTES {
            self.stats.evicted += 1;
            return;
        }
        while !self.early.is_empty()
            && (self.early.len() >= MAX_WAITING || self.early_bytes + bytes > MAX_WAITING_BYTES)
        {
            self.drop_oldest();
            self.stats.evicted += 1;
        }
        self.early_bytes += bytes;
        self.early.push_back(Early {
            sender: sender.to_vec(),
            registration,
            bytes,
            arrived: Instant::now(),
        });
    }

    fn drop_oldest(&mut self) {
        if let Some(early) = self.early.pop_front() {
            self.early_bytes -= early.bytes;
        }
    }

    /// Early registrations kept now, and their bytes.
    #[cfg(test)]
    fn waiting(&self) -> (usize, usize) {
        (self.early.len(), self.early_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vllm::push_reg::RegisteredBlocks;

    fn reg(id: &str) -> PushRegistration {
        PushRegistration {
            request_id: id.into(),
            decode_engine_id: "dc".into(),
            decode_host: "127.0.0.1".into(),
            decode_port: 1,
            decode_tp_size: 1,
            local_block_ids: RegisteredBlocks::Groups(vec![vec![1]]),
            remote_engine_id: "pf".into(),
            remote_host: "127.0.0.1".into(),
            remote_port: 2,
            remote_tp_size: 1,
            remote_pp_size: 1,
        }
    }

    #[test]
    fn a_registration_matches_by_exact_id_else_by_base_id_once() {
        let mut book = VllmPrefillBook::new(Duration::from_secs(30));
        assert!(book.ready("r-1a2b3c4d", HeldBlocks::of(&[3])).is_none());
        let write = book.registration(b"d", reg("r-0badf00d"), 10).unwrap();
        assert_eq!(write.request_id, "r-1a2b3c4d");
        assert_eq!(write.ready, HeldBlocks::of(&[3]));
        // One WRITE at a time: another registration waits while it runs.
        assert!(book.registration(b"e", reg("r-1a2b3c4d"), 10).is_none());
        assert!(book.registration(b"d", reg("other"), 10).is_none());
        assert_eq!(book.waiting().0, 2, "no match: they wait");
        // Given up before its WRITE: the registration kept for it starts.
        let again = book.unstart("r-1a2b3c4d").unwrap();
        assert_eq!(again.sender, b"e");
        assert_eq!(book.waiting().0, 1);
        book.released("r-1a2b3c4d");
        assert!(book.unstart("r-1a2b3c4d").is_none(), "released");
        assert!(book.registration(b"d", reg("r-1a2b3c4d"), 10).is_none());
        assert_eq!(
            book.waiting().0,
            2,
            "released: a late one waits, then expires"
        );
    }

    #[test]
    fn an_early_registration_waits_for_its_request_and_is_bounded() {
        let mut book = VllmPrefillBook::new(Duration::from_millis(50));
        assert!(book.registration(b"d", reg("early-1a2b3c4d"), 10).is_none());
        assert!(book.registration(b"d", reg("early"), 10).is_none());
        // The exact id is preferred to an earlier base-id match.
        let write = book.ready("early", HeldBlocks::of(&[1, 2])).unwrap();
        assert_eq!(write.registration.request_id, "early");
        assert_eq!(book.stats.waited, 1);
        for i in 0..MAX_WAITING + 10 {
            book.registration(b"d", reg(&format!("x{i}")), 10);
        }
        assert_eq!(book.waiting(), (MAX_WAITING, MAX_WAITING * 10));
        assert!(book
            .registration(b"d", reg("huge"), MAX_WAITING_BYTES + 1)
            .is_none());
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(book.expire(Instant::now()) as usize, MAX_WAITING);
        assert_eq!(book.waiting(), (0, 0));
        assert_eq!(book.stats.evicted as usize, MAX_WAITING + 12);
    }
}
