//! Decode's side of conversations of several turns (`--turns N`): what each conversation
//! holds in decode's cache between its turns, and the answer that ends each turn but the
//! last, kept for the next turn's prefill to read back.
//!
//! A conversation's blocks stay decode's from its first announcement to the end of its last
//! turn: after a turn is answered the connector keeps them for the read-back, and once the
//! next turn is announced they are that turn's prefix, which decode's prefix cache holds, so
//! only the turn's new blocks are loaded. They go back to the pool with the last turn.

use std::collections::HashMap;

use nixl_connector::{FinishStatus, KvConnectorScheduler, KvTransferParams};

use crate::block_pool::BlockPool;
use crate::conversation::{answer_blocks, Context, TurnId};
use crate::error::{Error, Result};
use crate::kv_cache::KvCache;

/// One conversation as decode holds it.
#[derive(Debug, Default)]
struct Conversation {
    context: Context,
    /// The local blocks holding the context, in order.
    blocks: Vec<u32>,
    /// Blocks taken with the turn's load for its answer, so that answering never waits.
    reserved: Vec<u32>,
    /// The last turn announced.
    turn: u32,
    /// Whether that turn was answered (the next one may come).
    answered: bool,
}

/// Decode's conversations, by conversation number.
#[derive(Debug)]
pub(super) struct Conversations {
    turns: u32,
    blocks_per_request: u32,
    most_answer: u32,
    /// Fault injection: the conversation whose first answer gets one wrong byte.
    corrupt_answer: Option<u64>,
    live: HashMap<u64, Conversation>,
    /// Turns answered and kept for a read-back.
    pub(super) answers: u64,
    /// Their blocks (tokens).
    pub(super) answer_blocks: u64,
}

/// What a turn's load covers: the whole prompt's local blocks and pattern keys, the first
/// `held` of them already in decode's cache.
pub(super) struct TurnLoad {
    pub(super) local: Vec<u32>,
    pub(super) keys: Vec<u32>,
    pub(super) held: usize,
}

impl Conversations {
    /// Conversations of `turns` turns, each turn's prompt adding `blocks_per_request`
    /// blocks, answers of at most `most_answer` blocks; the first answer of
    /// `corrupt_answer`, if any, gets one wrong byte.
    pub(super) fn new(
        turns: u32,
        blocks_per_request: u32,
        most_answer: u32,
        corrupt_answer: Option<u64>,
    ) -> Self {
        Conversations {
            turns,
            blocks_per_request,
            most_answer,
            corrupt_answer,
            live: HashMap::new(),
            answers: 0,
            answer_blocks: 0,
        }
    }

    /// Checks the announcement of turn `id` naming `blocks` prefill blocks (its whole
    /// prompt) and takes its new prompt blocks into the conversation.
    ///
    /// # Errors
    /// [`Error::Protocol`] for a turn out of order or past the last, or a prompt of another
    /// length than the conversation so far and the new blocks.
    pub(super) fn announced(&mut self, id: TurnId, blocks: usize) -> Result<()> {
        let bad = |reason: String| Err(Error::Protocol(format!("announcement of {id}: {reason}")));
        if id.turn > self.turns {
            return bad(format!("conversations have {} turns", self.turns));
        }
        let conversation = self.live.entry(id.conversation).or_default();
        let in_order = if id.turn == 1 {
            conversation.turn == 0
        } else {
            conversation.turn + 1 == id.turn && conversation.answered
        };
        if !in_order {
            return bad(format!(
                "the conversation is at turn {} ({})",
                conversation.turn,
                if conversation.answered {
                    "answered"
                } else {
                    "not answered"
                }
            ));
        }
        let expected = conversation.context.len() + self.blocks_per_request as usize;
        if blocks != expected {
            return bad(format!(
                "a prompt of {blocks} blocks; the conversation so far and {} new ones make {expected}",
                self.blocks_per_request
            ));
        }
        conversation.context.add_prompt(self.blocks_per_request);
        conversation.turn = id.turn;
        conversation.answered = false;
        Ok(())
    }

    /// The blocks turn `id`'s load takes: its new prompt blocks, and its answer's but on the
    /// last turn.
    pub(super) fn blocks_for(&self, id: TurnId) -> usize {
        let answer = if id.turn < self.turns {
            answer_blocks(id.conversation, id.turn, self.most_answer)
        } else {
            0
        };
        (self.blocks_per_request + answer) as usize
    }

    /// Turn `id`'s load into `taken`'s fresh local blocks ([`blocks_for`](Self::blocks_for)
    /// of them) after the conversation's own, which decode's prefix cache holds; those past
    /// the prompt wait for the answer.
    pub(super) fn load(&mut self, id: TurnId, taken: &[u32]) -> TurnLoad {
        let conversation = self.live.entry(id.conversation).or_default();
        let held = conversation.blocks.len();
        let (new, answer) = taken.split_at(taken.len().min(self.blocks_per_request as usize));
        conversation.blocks.extend_from_slice(new);
        conversation.reserved = answer.to_vec();
        TurnLoad {
            local: conversation.blocks.clone(),
            keys: conversation.context.keys().to_vec(),
            held,
        }
    }

    /// Turn `id` was loaded and checked. The last turn ends its conversation: its blocks go
    /// back to `pool`, and `None`. Any other is answered: decode writes the answer into the
    /// blocks its load took for it, in `cache`, and finishes the request with `scheduler`,
    /// which keeps the conversation's blocks for the read-back; the params that name them.
    ///
    /// # Errors
    /// [`Error::Config`] when the connector keeps nothing (read-backs off); the cache's
    /// errors.
    pub(super) fn answered(
        &mut self,
        id: TurnId,
        cache: &KvCache<'_>,
        pool: &mut BlockPool,
        scheduler: &mut KvConnectorScheduler,
    ) -> Result<Option<KvTransferParams>> {
        if id.turn == self.turns {
            if let Some(conversation) = self.live.remove(&id.conversation) {
                pool.free(&conversation.blocks);
            }
            return Ok(None);
        }
        let Some(conversation) = self.live.get_mut(&id.conversation) else {
            return Err(Error::Protocol(format!("{id} is not a live conversation")));
        };
        let blocks = std::mem::take(&mut conversation.reserved);
        let count = blocks.len() as u32;
        let start = conversation.context.len();
        conversation.context.add_answer(count);
        cache.compute_blocks(
            &blocks,
            &conversation.context.keys()[start..],
            id.conversation,
        )?;
        if id.turn == 1 && self.corrupt_answer == Some(id.conversation) {
            tracing::warn!(%id, "fault injection: corrupting the answer's first block");
            cache.corrupt_block(blocks[0])?;
        }
        conversation.blocks.extend_from_slice(&blocks);
        conversation.answered = true;
        let ids: Vec<usize> = conversation.blocks.iter().map(|&b| b as usize).collect();
        let done = scheduler.request_finished(
            &id.to_string(),
            &ids,
            ids.len(),
            None,
            FinishStatus::Stopped,
        );
        let params = done.kv_transfer_params.ok_or_else(|| {
            Error::Config(format!(
                "the connector kept nothing of {id} for a read-back: is bidirectional_kv_xfer off in the kv_transfer_config?"
            ))
        })?;
        self.answers += 1;
        self.answer_blocks += u64::from(count);
        Ok(Some(params))
    }
}
