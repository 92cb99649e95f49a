//! Multi-turn conversations of the demo (`decode --turns N`, vLLM 0.33's bidirectional KV
//! transfer): how each turn's prompt is made, which side wrote each of its blocks, and how a
//! turn's request is named.
//!
//! In this demo a block stands for one token. Turn 1's prompt is `blocks_per_request`
//! blocks that prefill computes; decode loads them and answers with
//! [`answer_blocks`] blocks of its own; turn `k + 1`'s prompt is turn `k`'s prompt, turn
//! `k`'s answer and `blocks_per_request` new blocks. Every block is a function of its
//! position in the conversation ([`Context::keys`]), with a pattern of its own for the
//! blocks decode wrote ([`ANSWER`]), so that either side checks any block without a copy:
//! prefill checks the answers it reads back, decode the prompts it loads and the blocks its
//! prefix cache kept.

use std::fmt;

use crate::error::{Error, Result};

/// Marks the pattern key of a block decode wrote (an answer), beside its position.
pub const ANSWER: u32 = 1 << 31;

/// The id of one turn's request on both engines: `<conversation>.<turn>`, the conversation
/// numbered by prefill, the turn from 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TurnId {
    /// The conversation, also the seed of its blocks' pattern.
    pub conversation: u64,
    /// The turn, from 1.
    pub turn: u32,
}

impl TurnId {
    /// Parses `<conversation>.<turn>`.
    ///
    /// # Errors
    /// [`Error::Protocol`] for anything else, or turn 0.
    pub fn parse(id: &str) -> Result<TurnId> {
        let parsed = id.split_once('.').and_then(|(c, t)| {
            let turn = t.parse().ok().filter(|&t| t > 0)?;
            Some(TurnId {
                conversation: c.parse().ok()?,
                turn,
            })
        });
        parsed.ok_or_else(|| {
            Error::Protocol(format!(
                "request id {id:?} is not <conversation>.<turn> (the turn from 1)"
            ))
        })
    }

    /// The next turn of the same conversation.
    pub fn next(self) -> TurnId {
        TurnId {
            turn: self.turn + 1,
            ..self
        }
    }
}

impl fmt::Display for TurnId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.conversation, self.turn)
    }
}

/// How many blocks decode answers turn `turn` of `conversation` with: 1 to `most`, varying
/// with both, so that some answers fall below a prefill's recompute threshold and others do
/// not.
pub fn answer_blocks(conversation: u64, turn: u32, most: u32) -> u32 {
    1 + ((conversation + u64::from(turn)) % u64::from(most.max(1))) as u32
}

/// The most blocks a turn's prompt of a conversation of `turns` turns takes: every turn's
/// new blocks and every answer but the last turn's, at their longest.
pub fn longest_prompt(turns: u32, blocks_per_request: u32, most_answer: u32) -> u64 {
    u64::from(turns) * u64::from(blocks_per_request)
        + u64::from(turns.saturating_sub(1)) * u64::from(most_answer)
}

/// What a conversation holds so far, block by block: each block's pattern key, its position
/// in the conversation, with [`ANSWER`] set on the blocks decode wrote.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Context {
    keys: Vec<u32>,
}

impl Context {
    /// The pattern keys of the blocks so far, in order.
    pub fn keys(&self) -> &[u32] {
        &self.keys
    }

    /// Blocks so far.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether the conversation holds nothing yet.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Adds `blocks` blocks of prompt (prefill writes them).
    pub fn add_prompt(&mut self, blocks: u32) {
        self.add(blocks, 0);
    }

    /// Adds `blocks` blocks of answer (decode writes them).
    pub fn add_answer(&mut self, blocks: u32) {
        self.add(blocks, ANSWER);
    }

    fn add(&mut self, blocks: u32, mark: u32) {
        let start = self.keys.len() as u32;
        self.keys.extend((start..start + blocks).map(|p| p | mark));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn turn_ids_round_trip_and_refuse_the_rest() {
        let id = TurnId {
            conversation: 17,
            turn: 3,
        };
        assert_eq!(id.to_string(), "17.3");
        assert_eq!(TurnId::parse("17.3").unwrap(), id);
        assert_eq!(id.next().to_string(), "17.4");
        for bad in ["17", "17.0", "x.1", "1.y", "", "1.2.3"] {
            assert!(TurnId::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_context_marks_the_answers() {
        let mut context = Context::default();
        context.add_prompt(2);
        context.add_answer(1);
        context.add_prompt(2);
        assert_eq!(context.keys(), [0, 1, 2 | ANSWER, 3, 4]);
        assert_eq!(context.len(), 5);
    }

    #[test]
    fn answers_vary_within_their_bound() {
        let lens: Vec<u32> = (0..8).map(|c| answer_blocks(c, 1, 4)).collect();
        assert_eq!(lens, [2, 3, 4, 1, 2, 3, 4, 1]);
        assert_eq!(answer_blocks(5, 2, 1), 1);
        assert_eq!(longest_prompt(3, 16, 4), 56);
        assert_eq!(longest_prompt(1, 16, 4), 16);
    }
}
