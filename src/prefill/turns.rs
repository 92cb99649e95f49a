//! Prefill's side of conversations of several turns (`decode --turns N`, vLLM 0.33's
//! bidirectional KV transfer; see [`conversation`](crate::conversation)).
//!
//! When decode has answered turn `k` it sends the params naming the blocks it keeps
//! ([`Message::Turn`](crate::protocol::Message::Turn)). Turn `k + 1`'s prompt is turn `k`'s
//! prompt, which prefill's own prefix cache holds (the demo writes its pattern again into
//! fresh blocks), then decode's answer, which prefill lacks, then new blocks. The connector
//! says how much of the answer is worth reading ([`read_back_tokens`]): that much is read
//! back from decode into the turn's blocks and every byte checked against the answer's
//! pattern; the rest (an answer below the recompute threshold, or a read that failed) is
//! computed here. Then the new blocks are computed and the turn is finished and announced as
//! any request.
//!
//! [`read_back_tokens`]: nixl_connector::KvConnectorScheduler::read_back_tokens

use std::collections::{HashMap, VecDeque};
use std::fmt;

use nixl_connector::{KvTransferParams, LoadOutcome};
use tokio::sync::mpsc;

use super::{engine_step, lock, Routed, Session};
use crate::conversation::{Context, TurnId};
use crate::error::{Error, Result};
use crate::kv_cache::Mismatch;
use crate::protocol::Hello;

/// What prefill did with the turns after the first of a session's conversations; a block is
/// a token in this demo.
#[derive(Debug, Clone, Default)]
pub struct ReadBackStats {
    /// Conversations.
    pub conversations: u64,
    /// Turns of each.
    pub turns: u32,
    /// Answer tokens read back from the decode's kept blocks.
    pub read_back_tokens: u64,
    /// Answer tokens computed here instead: below the recompute threshold, or their read
    /// failed.
    pub recomputed_tokens: u64,
    /// Tokens of each turn's previous prompt, held by prefill's own prefix cache.
    pub prefix_tokens: u64,
    /// New prompt tokens of the later turns, computed here.
    pub new_tokens: u64,
    /// Read-back blocks whose bytes were wrong.
    pub mismatches: Vec<Mismatch>,
}

/// Mismatches listed in full; the rest are counted.
const MISMATCHES_SHOWN: usize = 5;

impl fmt::Display for ReadBackStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} conversations of {} turns: read back {} tokens from the decode, recomputed {} \
             (below the recompute threshold or not read), {} from prefill's own prefix cache, \
             {} new; ",
            self.conversations,
            self.turns,
            self.read_back_tokens,
            self.recomputed_tokens,
            self.prefix_tokens,
            self.new_tokens
        )?;
        if self.mismatches.is_empty() {
            return write!(f, "every read-back byte verified");
        }
        write!(f, "{} read-back blocks mismatch", self.mismatches.len())?;
        for m in self.mismatches.iter().take(MISMATCHES_SHOWN) {
            write!(f, "\n    {m}")?;
        }
        Ok(())
    }
}

/// A conversation as prefill holds it.
#[derive(Debug, Default)]
struct Conversation {
    context: Context,
    /// The last turn announced.
    turn: u32,
}

/// A turn whose read-back is in flight.
#[derive(Debug)]
struct ReadBack {
    turn: TurnId,
    params: KvTransferParams,
    blocks: Vec<u32>,
    keys: Vec<u32>,
    /// Where the blocks read back start and end in `blocks`.
    read: (usize, usize),
    /// Where the new prompt blocks start in `blocks`.
    new_from: usize,
}

/// A session's conversations.
#[derive(Debug)]
pub(super) struct Turns {
    conversations: u64,
    turns: u32,
    blocks_per_request: u32,
    answer_blocks: u32,
    live: HashMap<u64, Conversation>,
    /// Answered turns waiting for free blocks, oldest first.
    waiting: VecDeque<(TurnId, KvTransferParams)>,
    /// Read-backs in flight, by request id.
    reading: HashMap<String, ReadBack>,
    /// What the session did.
    pub(super) stats: ReadBackStats,
}

impl Turns {
    /// The conversations `hello` asks for.
    pub(super) fn new(hello: &Hello) -> Self {
        let conversations = hello.requests / u64::from(hello.turns.max(1));
        Turns {
            conversations,
            turns: hello.turns,
            blocks_per_request: hello.blocks_per_request,
            answer_blocks: hello.answer_blocks,
            live: HashMap::new(),
            waiting: VecDeque::new(),
            reading: HashMap::new(),
            stats: ReadBackStats {
                conversations,
                turns: hello.turns,
                ..ReadBackStats::default()
            },
        }
    }

    /// Whether another conversation may start, `started` so far: fewer than `in_flight` run.
    pub(super) fn may_start(&self, started: u64, in_flight: usize) -> bool {
        started < self.conversations && self.live.len() < in_flight
    }

    /// Conversation `conversation` starts with a prompt of `blocks` blocks: their pattern
    /// keys.
    pub(super) fn started(&mut self, conversation: u64, blocks: u32) -> Vec<u32> {
        let live = self.live.entry(conversation).or_default();
        live.context.add_prompt(blocks);
        live.turn = 1;
        live.context.keys().to_vec()
    }

    /// Request `request` was released: the last turn's ends its conversation.
    pub(super) fn released(&mut self, request: &str) {
        if let Ok(id) = TurnId::parse(request) {
            if id.turn == self.turns {
                self.live.remove(&id.conversation);
            }
        }
    }

    /// The read-backs in flight, forgotten: the session ends.
    pub(super) fn abandon(&mut self) -> Vec<String> {
        self.waiting.clear();
        self.reading.drain().map(|(id, _)| id).collect()
    }

    /// Checks decode's params of an answered turn: the next turn and the answer's length.
    fn check_answered(&self, params: &KvTransferParams) -> Result<(TurnId, u32)> {
        let id = params.remote_request_id.as_deref().unwrap_or("");
        let bad = |reason: String| Err(Error::Protocol(format!("decode's turn {id:?}: {reason}")));
        let answered = TurnId::parse(id)?;
        let Some(live) = self.live.get(&answered.conversation) else {
            return bad("not a conversation of this session".into());
        };
        if live.turn != answered.turn || answered.turn >= self.turns {
            return bad(format!(
                "the conversation is at turn {} of {}",
                live.turn, self.turns
            ));
        }
        let kept = params.remote_num_tokens.unwrap_or(0);
        let answer = kept.saturating_sub(live.context.len());
        if answer == 0 || answer > self.answer_blocks as usize {
            return bad(format!(
                "{kept} tokens kept after a prompt of {}: answers take 1 to {} blocks",
                live.context.len(),
                self.answer_blocks
            ));
        }
        if params.remote_block_ids.len() != kept {
            return bad(format!(
                "{} blocks kept for {kept} tokens",
                params.remote_block_ids.len()
            ));
        }
        Ok((answered.next(), answer as u32))
    }
}

impl Session<'_> {
    /// Decode answered a turn (`params` name the blocks it keeps): its next turn waits for
    /// free blocks.
    pub(super) fn turn_answered(&mut self, mut params: KvTransferParams) -> Result<()> {
        let Some(turns) = self.turns.as_mut() else {
            return Ok(());
        };
        let (next, _) = turns.check_answered(&params)?;
        // Read from the decode this session serves, wherever the params point.
        params.remote_host = Some(self.peer_ip.to_string());
        turns.waiting.push_back((next, params));
        Ok(())
    }

    /// Starts the waiting turns while free blocks allow; `false` when one still waits.
    pub(super) async fn next_turns(
        &mut self,
        released: &mpsc::UnboundedSender<Routed>,
    ) -> Result<bool> {
        loop {
            let Some(turns) = self.turns.as_mut() else {
                return Ok(true);
            };
            let Some((next, params)) = turns.waiting.front() else {
                return Ok(true);
            };
            let (_, answer) = turns.check_answered(params)?;
            let held = turns.live[&next.conversation].context.len();
            let count = held + answer as usize + turns.blocks_per_request as usize;
            let Some(blocks) = lock(&self.shared.pool).alloc(count) else {
                return Ok(false);
            };
            let Some((next, params)) = turns.waiting.pop_front() else {
                return Ok(true);
            };
            self.start_turn(next, params, blocks, answer, released)
                .await?;
        }
    }

    /// Prefills turn `next` into `blocks`: the previous prompt from prefill's prefix cache,
    /// then the read-back of what the connector finds worth reading of the `answer` blocks
    /// (the turn goes on when it ends), or the answer computed here.
    async fn start_turn(
        &mut self,
        next: TurnId,
        params: KvTransferParams,
        blocks: Vec<u32>,
        answer: u32,
        released: &mpsc::UnboundedSender<Routed>,
    ) -> Result<()> {
        let cache = self.shared.worker.cache()?;
        let Some(turns) = self.turns.as_mut() else {
            return Ok(());
        };
        let conversation = next.conversation;
        let live = turns.live.entry(conversation).or_default();
        let held = live.context.len();
        live.context.add_answer(answer);
        live.context.add_prompt(turns.blocks_per_request);
        live.turn = next.turn;
        let keys = live.context.keys().to_vec();
        cache.compute_blocks(&blocks[..held], &keys[..held], conversation)?;
        turns.stats.prefix_tokens += held as u64;
        let new_from = held + answer as usize;
        let id = next.to_string();
        lock(&self.shared.owners).insert(id.clone(), released.clone());
        self.outstanding.insert(id.clone(), blocks.clone());
        let read = {
            let mut scheduler = lock(&self.shared.scheduler);
            let read = scheduler
                .read_back_tokens(Some(&params), keys.len(), held)
                .min(answer as usize);
            // What is read pairs with the tail of the decode's blocks: the answer's tail.
            let local: Vec<usize> = blocks[new_from - read..new_from]
                .iter()
                .map(|&b| b as usize)
                .collect();
            scheduler.on_new_request(&id, Some(&params));
            scheduler.update_state_after_alloc(&id, &local, &params)?;
            engine_step(self.shared, &mut scheduler);
            read
        };
        let unread = held..new_from - read;
        cache.compute_blocks(&blocks[unread.clone()], &keys[unread], conversation)?;
        turns.stats.recomputed_tokens += (answer as usize - read) as u64;
        let read_back = ReadBack {
            turn: next,
            params,
            blocks,
            keys,
            read: (new_from - read, new_from),
            new_from,
        };
        if read == 0 {
            // Nothing to read: the connector only tells the decode.
            return self.finish_turn(read_back, released).await;
        }
        turns.reading.insert(id, read_back);
        Ok(())
    }

    /// A read-back ended with `outcome`: checks what landed, computes what did not, and
    /// finishes the turn.
    pub(super) async fn read_back_ended(
        &mut self,
        outcome: LoadOutcome,
        released: &mpsc::UnboundedSender<Routed>,
    ) -> Result<()> {
        let cache = self.shared.worker.cache()?;
        let Some(turns) = self.turns.as_mut() else {
            return Ok(());
        };
        let (request_id, failed) = match outcome {
            LoadOutcome::Loaded { request_id } => (request_id, Vec::new()),
            LoadOutcome::Recompute {
                request_id,
                block_ids,
                reason,
            } => {
                tracing::warn!(request = %request_id, blocks = block_ids.len(), %reason, "read-back failed; computing its blocks here");
                (request_id, block_ids)
            }
            LoadOutcome::Failed { request_id, reason } => {
                return Err(Error::LoadFailed(format!(
                    "reading back {request_id} from the decode failed: {reason}"
                )))
            }
            LoadOutcome::AbortedLoadEnded { .. } => return Ok(()),
        };
        let Some(read_back) = turns.reading.remove(&request_id) else {
            return Ok(());
        };
        let (start, end) = read_back.read;
        let conversation = read_back.turn.conversation;
        let (mut landed, mut redo) = ((Vec::new(), Vec::new()), (Vec::new(), Vec::new()));
        for (&block, &key) in read_back.blocks[start..end]
            .iter()
            .zip(&read_back.keys[start..end])
        {
            let side = if failed.contains(&(block as usize)) {
                &mut redo
            } else {
                &mut landed
            };
            side.0.push(block);
            side.1.push(key);
        }
        let bad = cache.verify_blocks(&landed.0, &landed.1, conversation)?;
        turns.stats.mismatches.extend(bad);
        turns.stats.read_back_tokens += landed.0.len() as u64;
        cache.compute_blocks(&redo.0, &redo.1, conversation)?;
        turns.stats.recomputed_tokens += redo.0.len() as u64;
        self.finish_turn(read_back, released).await
    }

    /// Computes the turn's new prompt blocks, then finishes and announces it.
    async fn finish_turn(
        &mut self,
        read_back: ReadBack,
        released: &mpsc::UnboundedSender<Routed>,
    ) -> Result<()> {
        let cache = self.shared.worker.cache()?;
        let ReadBack {
            turn,
            params,
            blocks,
            keys,
            new_from,
            ..
        } = read_back;
        cache.compute_blocks(&blocks[new_from..], &keys[new_from..], turn.conversation)?;
        if let Some(turns) = self.turns.as_mut() {
            turns.stats.new_tokens += (blocks.len() - new_from) as u64;
        }
        self.finish_and_announce(turn.to_string(), blocks, &params, released)
            .await
    }
}
