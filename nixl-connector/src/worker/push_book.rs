//! Push mode's bookkeeping, as plain state the async side (`push.rs`) drives: on a prefill
//! rank, the requests whose blocks are ready to be written and the registrations and
//! cancels that came before them (bounded in count and bytes, dropped after a time); on a
//! decode rank, each registered load's prefill ranks and how each ended.
//!
//! Nothing here trusts a message: a registration or cancel counts only with the tag of the
//! request's capability for its sender, checked once the request is ready here; an end
//! counts only from an agent the load registered with, once, with the tag of the load's
//! capability.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::transport::capability::Capability;
use crate::transport::push_wire::{
    EndProof, PushEnd, Registration, RegistrationKind, SignedEnd, SignedRegistration,
};

/// Most registrations and cancels a prefill rank keeps for requests it does not hold yet.
pub(crate) const MAX_WAITING: usize = 4096;
/// Most bytes of them it keeps.
pub(crate) const MAX_WAITING_BYTES: usize = 16 << 20;
/// Most requests released here whose capability is kept to answer a late message.
const MAX_RECENT: usize = 4096;

/// A prefill request whose blocks may be written.
#[derive(Debug, Clone)]
pub(crate) struct Ready {
    /// Its blocks.
    pub(crate) blocks: HeldBlocks,
    /// The capability of its params.
    pub(crate) capability: Capability,
    /// Whether a registration was matched (a WRITE is or was under way): later ones are
    /// refused.
    started: bool,
}

/// A held request's blocks, which a push writes from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct HeldBlocks {
    /// Its blocks, in token order (each KV cache group's in turn).
    pub(crate) block_ids: Vec<usize>,
    /// How many of them each group has; empty: one group.
    pub(crate) group_lens: Vec<usize>,
    /// The prompt's tokens it computed, if known: where a decode's blocks start in the
    /// prompt when the engines' blocks differ in tokens or in kernel blocks per id.
    pub(crate) num_tokens: Option<usize>,
}

#[cfg(test)]
impl HeldBlocks {
    /// One group's `block_ids`, of tokens not given.
    pub(crate) fn of(block_ids: &[usize]) -> Self {
        HeldBlocks {
            block_ids: block_ids.to_vec(),
            ..HeldBlocks::default()
        }
    }
}

/// A registration or cancel that came before its request was ready.
#[derive(Debug)]
struct Waiting {
    sender: Vec<u8>,
    message: SignedRegistration,
    bytes: usize,
    arrived: Instant,
}

/// What the prefill rank must do next.
#[derive(Debug)]
pub(crate) enum PrefillAction {
    /// Write `ready`'s blocks into the decode blocks `registration` names, for `sender`.
    Write {
        request_id: String,
        sender: Vec<u8>,
        registration: Box<SignedRegistration>,
        ready: Ready,
    },
    /// Tell `sender`, the decode rank `registration` names, that its part ended so.
    End {
        sender: Vec<u8>,
        registration: Registration,
        end: PushEnd,
        proof: EndProof,
    },
    /// Release the request now (its decode wants nothing written).
    Release { request_id: String },
}

/// What push mode did on a prefill rank so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct PrefillPushStats {
    /// Registrations that matched a ready request.
    pub(crate) matched: u64,
    /// Registrations that waited for their request to be ready.
    pub(crate) waited: u64,
    /// Registrations and cancels dropped unmatched: past the bounds or their time.
    pub(crate) evicted: u64,
    /// Messages without a valid tag, or that do not parse.
    pub(crate) refused: u64,
}

/// A prefill rank's book.
#[derive(Debug)]
pub(crate) struct PrefillBook {
    ready: HashMap<String, Ready>,
    waiting: HashMap<String, Vec<Waiting>>,
    order: VecDeque<(Instant, String)>,
    waiting_count: usize,
    waiting_bytes: usize,
    /// How long a registration may wait for its request.
    ttl: Duration,
    /// Released requests' capabilities, to answer a late registration or cancel `gone`.
    recent: HashMap<String, Capability>,
    recent_order: VecDeque<String>,
    /// (request, sender) pairs whose cancel was answered while the request was not held
    /// here, the oldest dropped past [`MAX_WAITING`]: a registration of theirs that comes
    /// late (NIXL keeping no order between them) is refused.
    cancelled: HashSet<(String, Vec<u8>)>,
    cancelled_order: VecDeque<(String, Vec<u8>)>,
    pub(crate) stats: PrefillPushStats,
}

impl PrefillBook {
    /// A book whose early messages wait at most `ttl`.
    pub(crate) fn new(ttl: Duration) -> Self {
        PrefillBook {
            ready: HashMap::new(),
            waiting: HashMap::new(),
            order: VecDeque::new(),
            waiting_count: 0,
            waiting_bytes: 0,
            ttl,
            recent: HashMap::new(),
            recent_order: VecDeque::new(),
            cancelled: HashSet::new(),
            cancelled_order: VecDeque::new(),
            stats: PrefillPushStats::default(),
        }
    }

    /// `request_id`'s blocks are ready (the request is held); the messages that waited for
    /// it are taken in their order.
    pub(crate) fn ready(
        &mut self,
        request_id: &str,
        blocks: HeldBlocks,
        capability: Capability,
    ) -> Vec<PrefillAction> {
        if self.ready.contains_key(request_id) {
            // Held again while held: the first hold (and any WRITE it started) stands.
            return Vec::new();
        }
        if self.recent.remove(request_id).is_some() {
            self.recent_order.retain(|id| id != request_id);
        }
        self.ready.insert(
            request_id.to_string(),
            Ready {
                blocks,
                capability,
                started: false,
            },
        );
        let early = self.waiting.remove(request_id).unwrap_or_default();
        let mut actions = Vec::new();
        for waiting in early {
            self.waiting_count -= 1;
            self.waiting_bytes -= waiting.bytes;
            if waiting.message.kind == RegistrationKind::Register {
                self.stats.waited += 1;
            }
            actions.extend(self.registration(&waiting.sender, waiting.message));
        }
        actions
    }

    /// A registration or cancel from agent `sender`.
    pub(crate) fn registration(
        &mut self,
        sender: &[u8],
        signed: SignedRegistration,
    ) -> Vec<PrefillAction> {
        let request_id = signed.registration.request_id.clone();
        let end = |signed: SignedRegistration, end, capability: &Capability| {
            vec![PrefillAction::End {
                sender: sender.to_vec(),
                registration: signed.registration,
                end,
                proof: EndProof::Capability(capability.clone()),
            }]
        };
        if let Some(capability) = self.recent.get(&request_id) {
            if !signed.verify(capability, sender) {
                self.stats.refused += 1;
                return Vec::new();
            }
            return end(signed, PushEnd::Gone, capability);
        }
        let key = (request_id.clone(), sender.to_vec());
        if signed.kind == RegistrationKind::Register && self.cancelled.contains(&key) {
            // Its cancel came first and was answered: the decode may reuse the blocks.
            self.stats.refused += 1;
            return Vec::new();
        }
        let Some(ready) = self.ready.get_mut(&request_id) else {
            if signed.kind == RegistrationKind::Cancel {
                return self.cancel_unheld(sender, signed);
            }
            let bytes = signed.bytes() + sender.len();
            self.wait(&request_id, sender, signed, bytes);
            return Vec::new();
        };
        if !signed.verify(&ready.capability, sender) {
            self.stats.refused += 1;
            return Vec::new();
        }
        let capability = ready.capability.clone();
        match (signed.kind, ready.started) {
            // A WRITE is under way: its end follows once NIXL has ended it.
            (RegistrationKind::Cancel, true) => return Vec::new(),
            (RegistrationKind::Cancel, false) => {
                // A cancel of no block (a full prefix hit) waits for no answer.
                let answer = !signed.registration.block_ids.is_empty();
                let mut actions = vec![PrefillAction::Release { request_id }];
                if answer {
                    actions.extend(end(signed, PushEnd::Cancelled, &capability));
                }
                return actions;
            }
            (RegistrationKind::Register, true) => {
                return end(signed, PushEnd::Refused, &capability)
            }
            (RegistrationKind::Register, false) => {}
        }
        ready.started = true;
        self.stats.matched += 1;
        vec![PrefillAction::Write {
            request_id,
            sender: sender.to_vec(),
            registration: Box::new(signed),
            ready: ready.clone(),
        }]
    }

    /// A cancel of a request this rank does not hold: its registrations from `sender` that
    /// wait are dropped, so no WRITE of them can start (a sender's registration comes
    /// before its cancel: NIXL's notifications between two agents keep their order), and
    /// `sender` hears `cancelled`, proven by the cancel's nonce (the capability is not known
    /// here yet).
    fn cancel_unheld(&mut self, sender: &[u8], cancel: SignedRegistration) -> Vec<PrefillAction> {
        let request_id = cancel.registration.request_id.clone();
        if let Some(list) = self.waiting.get_mut(&request_id) {
            let mut freed = (0, 0);
            list.retain(|w| {
                let drop = w.sender == sender;
                if drop {
                    freed = (freed.0 + 1, freed.1 + w.bytes);
                }
                !drop
            });
            if list.is_empty() {
                self.waiting.remove(&request_id);
            }
            self.waiting_count -= freed.0;
            self.waiting_bytes -= freed.1;
        }
        if cancel.registration.block_ids.is_empty() || cancel.registration.nonce.is_empty() {
            return Vec::new();
        }
        // A registration of the sender's that comes after its cancel is never written.
        let key = (request_id, sender.to_vec());
        if self.cancelled.insert(key.clone()) {
            if self.cancelled_order.len() >= MAX_WAITING {
                if let Some(oldest) = self.cancelled_order.pop_front() {
                    self.cancelled.remove(&oldest);
                }
            }
            self.cancelled_order.push_back(key);
        }
        let nonce = cancel.registration.nonce.clone();
        vec![PrefillAction::End {
            sender: sender.to_vec(),
            registration: cancel.registration,
            end: PushEnd::Cancelled,
            proof: EndProof::Nonce(nonce),
        }]
    }

    /// `request_id` was released (written, cancelled, or its lease ended): its capability
    /// is kept a while to answer late messages, and what waited for it is dropped.
    pub(crate) fn released(&mut self, request_id: &str) {
        let Some(ready) = self.ready.remove(request_id) else {
            return;
        };
        if self.recent_order.len() >= MAX_RECENT {
            if let Some(oldest) = self.recent_order.pop_front() {
                self.recent.remove(&oldest);
            }
        }
        self.recent.insert(request_id.to_string(), ready.capability);
        self.recent_order.push_back(request_id.to_string());
    }

    /// Drops early messages older than the book's time, and returns how many it dropped.
    pub(crate) fn expire(&mut self, now: Instant) -> u64 {
        let mut dropped = 0;
        while let Some((arrived, _)) = self.order.front() {
            if now.saturating_duration_since(*arrived) < self.ttl {
                break;
            }
            let (arrived, id) = self.order.pop_front().unwrap_or((now, String::new()));
            dropped += self.drop_waiting(&id, Some(arrived));
        }
        self.stats.evicted += dropped;
        dropped
    }

    /// Keeps an early message for `request_id`, dropping the oldest past the bounds.
    fn wait(&mut self, request_id: &str, sender: &[u8], message: SignedRegistration, bytes: usize) {
        if bytes > MAX_WAITING_BYTES {
            self.stats.evicted += 1;
            return;
        }
        while self.waiting_count >= MAX_WAITING || self.waiting_bytes + bytes > MAX_WAITING_BYTES {
            let Some((_, oldest)) = self.order.pop_front() else {
                break;
            };
            self.stats.evicted += self.drop_waiting(&oldest, None);
        }
        let now = Instant::now();
        self.waiting_count += 1;
        self.waiting_bytes += bytes;
        self.order.push_back((now, request_id.to_string()));
        self.waiting
            .entry(request_id.to_string())
            .or_default()
            .push(Waiting {
                sender: sender.to_vec(),
                message,
                bytes,
                arrived: now,
            });
    }

    /// Drops the early messages of `request_id` (those that arrived at `arrived`, or all).
    fn drop_waiting(&mut self, request_id: &str, arrived: Option<Instant>) -> u64 {
        let Some(list) = self.waiting.get_mut(request_id) else {
            return 0;
        };
        let before = list.len();
        let mut freed = 0;
        list.retain(|w| {
            let drop = arrived.map_or(true, |at| w.arrived == at);
            if drop {
                freed += w.bytes;
            }
            !drop
        });
        let dropped = before - list.len();
        if list.is_empty() {
            self.waiting.remove(request_id);
        }
        self.waiting_count -= dropped;
        self.waiting_bytes -= freed;
        dropped as u64
    }

    /// Early messages kept now, and their bytes.
    #[cfg(test)]
    fn waiting(&self) -> (usize, usize) {
        (self.waiting_count, self.waiting_bytes)
    }
}

/// One decode load waiting for its prefill ranks' ends.
#[derive(Debug)]
struct Wait {
    /// The agents registered with, and how each ended.
    agents: Vec<(String, Option<PushEnd>)>,
    /// What proves an end: the capability's tag (native protocol), or, in vLLM's, the
    /// count its WRITE's notification must carry (the prefill's TP size).
    proof: WaitProof,
    /// The nonce of the load's cancel, once it cancelled.
    nonce: String,
    woken: Arc<tokio::sync::Notify>,
}

/// What proves a load's ends.
#[derive(Debug, Clone)]
pub(crate) enum WaitProof {
    /// Native protocol: the tag of the load's capability.
    Capability(Capability),
    /// vLLM's protocol: the WRITE's notification `id:count` with this count.
    #[cfg_attr(not(feature = "vllm"), allow(dead_code))]
    VllmCount(u64),
}

/// Why an end did not count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EndRefused {
    /// No load of this rank waits for that request.
    Unknown,
    /// Its sender is not an agent the load registered with, or already ended.
    WrongPeer,
    /// Its tag is not the load's capability's for its sender.
    BadTag,
    /// vLLM's protocol: its count is not the prefill's TP size.
    #[cfg_attr(not(feature = "vllm"), allow(dead_code))]
    BadCount,
}

/// A decode rank's loads waiting for their prefill ranks.
#[derive(Debug, Default)]
pub(crate) struct DecodeWaits {
    waits: HashMap<String, Wait>,
}

impl DecodeWaits {
    /// Waits for `request_id`'s ends from `agents`, proven by `proof`; what wakes the load.
    pub(crate) fn wait(
        &mut self,
        request_id: &str,
        agents: &[String],
        proof: WaitProof,
    ) -> Arc<tokio::sync::Notify> {
        let woken = Arc::new(tokio::sync::Notify::new());
        self.waits.insert(
            request_id.to_string(),
            Wait {
                agents: agents.iter().map(|a| (a.clone(), None)).collect(),
                proof,
                nonce: String::new(),
                woken: woken.clone(),
            },
        );
        woken
    }

    /// Takes an end from agent `sender`.
    pub(crate) fn ended(&mut self, sender: &[u8], end: &SignedEnd<'_>) -> Result<(), EndRefused> {
        let wait = self
            .waits
            .get_mut(end.decode_request_id)
            .ok_or(EndRefused::Unknown)?;
        let slot = wait
            .agents
            .iter_mut()
            .find(|(agent, ended)| agent.as_bytes() == sender && ended.is_none())
            .ok_or(EndRefused::WrongPeer)?;
        let WaitProof::Capability(capability) = &wait.proof else {
            return Err(EndRefused::BadTag);
        };
        if !end.verify(capability, sender, &wait.nonce) {
            return Err(EndRefused::BadTag);
        }
        slot.1 = Some(end.end);
        wait.woken.notify_one();
        Ok(())
    }

    /// vLLM's protocol: agent `sender`'s WRITE into `request_id`'s blocks landed, its
    /// notification counting `count`. It counts once per agent the load registered with.
    #[cfg_attr(not(feature = "vllm"), allow(dead_code))]
    pub(crate) fn written(
        &mut self,
        sender: &[u8],
        request_id: &str,
        count: u64,
    ) -> Result<(), EndRefused> {
        let wait = self.waits.get_mut(request_id).ok_or(EndRefused::Unknown)?;
        let WaitProof::VllmCount(expected) = wait.proof else {
            return Err(EndRefused::BadTag);
        };
        let slot = wait
            .agents
            .iter_mut()
            .find(|(agent, ended)| agent.as_bytes() == sender && ended.is_none())
            .ok_or(EndRefused::WrongPeer)?;
        if count != expected {
            return Err(EndRefused::BadCount);
        }
        slot.1 = Some(PushEnd::Written);
        wait.woken.notify_one();
        Ok(())
    }

    /// `request_id`'s load cancels with `nonce`.
    pub(crate) fn cancelling(&mut self, request_id: &str, nonce: &str) {
        if let Some(wait) = self.waits.get_mut(request_id) {
            wait.nonce = nonce.to_string();
        }
    }

    /// Wakes `request_id`'s load (it was aborted).
    pub(crate) fn wake(&self, request_id: &str) {
        if let Some(wait) = self.waits.get(request_id) {
            wait.woken.notify_one();
        }
    }

    /// How `request_id`'s agents ended so far, in the order registered; `None` for one that
    /// has not.
    pub(crate) fn ends(&self, request_id: &str) -> Vec<(String, Option<PushEnd>)> {
        self.waits
            .get(request_id)
            .map_or(Vec::new(), |w| w.agents.clone())
    }

    /// Whether no load waits.
    pub(crate) fn is_empty(&self) -> bool {
        self.waits.is_empty()
    }

    /// Forgets `request_id`'s wait (its load ended).
    pub(crate) fn done(&mut self, request_id: &str) {
        self.waits.remove(request_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::push_wire::{
        cancel_message, end_message, parse_cancel, parse_end, parse_registration,
        registration_message, Registration,
    };

    fn cancel(request: &str, cap: &Capability, sender: &str) -> SignedRegistration {
        let mut registration = signed(request, cap, sender).registration;
        registration.nonce = "n".repeat(64);
        parse_cancel(&cancel_message(&registration, cap, sender)).unwrap()
    }

    fn signed(request: &str, cap: &Capability, sender: &str) -> SignedRegistration {
        let registration = Registration {
            request_id: request.into(),
            decode_request_id: format!("d-{request}"),
            engine_id: "decode".into(),
            host: "127.0.0.1".into(),
            port: 1,
            tp_size: 1,
            tp_rank: 0,
            block_ids: vec![1, 2],
            group_lens: vec![],
            nonce: String::new(),
        };
        parse_registration(&registration_message(&registration, cap, sender)).unwrap()
    }

    #[test]
    fn a_registration_before_its_request_waits_then_matches_once() {
        let cap = Capability::random().unwrap();
        let mut book = PrefillBook::new(Duration::from_secs(30));
        assert!(book.registration(b"d0", signed("r", &cap, "d0")).is_empty());
        assert_eq!(book.waiting().0, 1);
        let actions = book.ready("r", HeldBlocks::of(&[5, 6, 7]), cap.clone());
        assert!(
            matches!(&actions[..], [PrefillAction::Write { request_id, .. }] if request_id == "r")
        );
        assert_eq!(book.waiting(), (0, 0));
        assert_eq!((book.stats.matched, book.stats.waited), (1, 1));
        // Held again, it keeps its first hold: nothing starts again.
        assert!(book
            .ready("r", HeldBlocks::of(&[5, 6, 7]), cap.clone())
            .is_empty());
        // A second registration for it is refused, with an end the decode can prove.
        let again = book.registration(b"d0", signed("r", &cap, "d0"));
        assert!(matches!(
            &again[..],
            [PrefillAction::End {
                end: PushEnd::Refused,
                ..
            }]
        ));
        // Once released, a late one hears `gone`.
        book.released("r");
        let late = book.registration(b"d0", signed("r", &cap, "d0"));
        assert!(matches!(
            &late[..],
            [PrefillAction::End {
                end: PushEnd::Gone,
                ..
            }]
        ));
    }

    #[test]
    fn forged_registrations_and_cancels_do_nothing() {
        let cap = Capability::random().unwrap();
        let forger = Capability::random().unwrap();
        let mut book = PrefillBook::new(Duration::from_secs(30));
        book.ready("r", HeldBlocks::of(&[5]), cap.clone());
        assert!(book
            .registration(b"d0", signed("r", &forger, "d0"))
            .is_empty());
        // Signed for another agent than the one that sent it.
        assert!(book
            .registration(b"evil", signed("r", &cap, "d0"))
            .is_empty());
        assert!(book
            .registration(b"evil", cancel("r", &cap, "d0"))
            .is_empty());
        assert_eq!(book.stats.refused, 3);
        // A proven cancel before any registration releases it, and tells the decode.
        let actions = book.registration(b"d0", cancel("r", &cap, "d0"));
        assert!(matches!(&actions[..], [
            PrefillAction::Release { request_id },
            PrefillAction::End { end: PushEnd::Cancelled, .. },
        ] if request_id == "r"));
    }

    #[test]
    fn a_cancel_before_the_hold_drops_the_registration_and_answers_with_its_nonce() {
        let cap = Capability::random().unwrap();
        let mut book = PrefillBook::new(Duration::from_secs(30));
        book.registration(b"d0", signed("r", &cap, "d0"));
        book.registration(b"d1", signed("r", &cap, "d1"));
        let actions = book.registration(b"d0", cancel("r", &cap, "d0"));
        assert!(matches!(&actions[..], [PrefillAction::End {
            end: PushEnd::Cancelled,
            proof: EndProof::Nonce(nonce),
            ..
        }] if *nonce == "n".repeat(64)));
        // Only d1's registration is left to write once the request is held.
        let actions = book.ready("r", HeldBlocks::of(&[5, 6]), cap.clone());
        assert!(matches!(&actions[..], [PrefillAction::Write { sender, .. }] if sender == b"d1"));
        assert_eq!(book.waiting(), (0, 0));
        // d0's registration arriving after its cancel is refused, held request or not.
        assert!(book.registration(b"d0", signed("r", &cap, "d0")).is_empty());
        book.registration(b"d0", cancel("q", &cap, "d0"));
        assert!(book.registration(b"d0", signed("q", &cap, "d0")).is_empty());
        assert!(
            book.ready("q", HeldBlocks::of(&[1, 2]), cap).is_empty(),
            "nothing to write"
        );
    }

    #[test]
    fn early_messages_are_bounded_and_dropped_in_time() {
        let cap = Capability::random().unwrap();
        let mut book = PrefillBook::new(Duration::from_millis(50));
        for i in 0..MAX_WAITING + 10 {
            book.registration(b"d0", signed(&format!("r{i}"), &cap, "d0"));
        }
        let (count, bytes) = book.waiting();
        assert_eq!(count, MAX_WAITING);
        assert!(bytes <= MAX_WAITING_BYTES);
        assert_eq!(book.stats.evicted, 10);
        // The oldest went first: r0 is gone, the last is kept.
        assert!(book
            .ready("r0", HeldBlocks::of(&[1]), cap.clone())
            .is_empty());
        assert_eq!(
            book.ready(
                &format!("r{}", MAX_WAITING + 9),
                HeldBlocks::of(&[1, 2]),
                cap
            )
            .len(),
            1
        );
        std::thread::sleep(Duration::from_millis(60));
        let dropped = book.expire(Instant::now());
        assert_eq!(dropped as usize, MAX_WAITING - 1);
        assert_eq!(book.waiting(), (0, 0));
    }

    #[test]
    fn an_end_counts_once_from_a_registered_agent_with_the_right_tag() {
        let cap = Capability::random().unwrap();
        let mut waits = DecodeWaits::default();
        let agents = ["p0".into(), "p1".into()];
        waits.wait("d-r", &agents, WaitProof::Capability(cap.clone()));
        let proof = EndProof::Capability(cap.clone());
        let end = end_message("d-r", PushEnd::Written, &proof, "p0");
        let parsed = parse_end(&end).unwrap();
        assert_eq!(waits.ended(b"p9", &parsed), Err(EndRefused::WrongPeer));
        assert_eq!(waits.ended(b"p1", &parsed), Err(EndRefused::BadTag));
        assert_eq!(waits.ended(b"p0", &parsed), Ok(()));
        assert_eq!(
            waits.ended(b"p0", &parsed),
            Err(EndRefused::WrongPeer),
            "once"
        );
        let other = end_message("d-x", PushEnd::Written, &proof, "p1");
        assert_eq!(
            waits.ended(b"p1", &parse_end(&other).unwrap()),
            Err(EndRefused::Unknown)
        );
        let ends = waits.ends("d-r");
        assert_eq!(ends[0].1, Some(PushEnd::Written));
        assert_eq!(ends[1].1, None);
    }

    #[test]
    fn a_vllm_write_counts_once_from_a_registered_agent_with_the_prefills_tp() {
        let mut waits = DecodeWaits::default();
        waits.wait("d-r", &["p0".into(), "p1".into()], WaitProof::VllmCount(2));
        assert_eq!(waits.written(b"p9", "d-r", 2), Err(EndRefused::WrongPeer));
        assert_eq!(waits.written(b"p0", "d-x", 2), Err(EndRefused::Unknown));
        assert_eq!(waits.written(b"p0", "d-r", 1), Err(EndRefused::BadCount));
        assert_eq!(waits.written(b"p0", "d-r", 2), Ok(()));
        assert_eq!(
            waits.written(b"p0", "d-r", 2),
            Err(EndRefused::WrongPeer),
            "once"
        );
        assert_eq!(waits.ends("d-r")[1].1, None);
        assert_eq!(waits.written(b"p1", "d-r", 2), Ok(()));
        let cap = Capability::random().unwrap();
        let end = end_message("d-r", PushEnd::Written, &EndProof::Capability(cap), "p1");
        assert_eq!(
            waits.ended(b"p1", &parse_end(&end).unwrap()),
            Err(EndRefused::WrongPeer)
        );
    }
}
