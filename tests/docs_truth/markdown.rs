//! The parts of a Markdown document that the docs test reads: its blocks (paragraphs, list
//! items, table rows and headings, fenced code left out), their code spans and links, and
//! the anchors its headings give.

/// One block of a document: a paragraph, a list item without its nested items, a table row
/// or a heading.
pub struct Block {
    /// The heading the block sits under (for a heading, its own text).
    pub section: String,
    /// The block's lines, each trimmed, joined by single spaces.
    pub text: String,
    /// Where each line starts in `text`, with its line number (from 1) in the document.
    starts: Vec<(usize, usize)>,
}

impl Block {
    /// The document's line number of byte `offset` of [`text`](Self::text).
    pub fn line_at(&self, offset: usize) -> usize {
        self.starts
            .iter()
            .rev()
            .find(|(start, _)| *start <= offset)
            .map_or(0, |(_, line)| *line)
    }

    fn push_line(&mut self, line: &str, number: usize) {
        if !self.text.is_empty() {
            self.text.push(' ');
        }
        self.starts.push((self.text.len(), number));
        self.text.push_str(line.trim());
    }
}

/// A code span of a block: its text (trimmed) and its byte range in the block's text,
/// backticks included.
pub struct Span {
    /// What is between the backticks, trimmed.
    pub text: String,
    /// Where the opening backticks start.
    pub start: usize,
    /// Where the closing backticks end.
    pub end: usize,
}

/// The blocks of `doc`, in order. A blank line, a heading, a table row and the start of a
/// list item (`- `, `* `, `1. `) each end the block before; fenced code (```` ``` ````) is
/// no block.
pub fn blocks(doc: &str) -> Vec<Block> {
    let mut blocks = Vec::new();
    let mut section = String::new();
    let mut current: Option<Block> = None;
    let mut in_fence = false;
    for (index, line) in doc.lines().enumerate() {
        let number = index + 1;
        let trimmed = line.trim_start();
        let fence = trimmed.starts_with("```");
        if fence || in_fence || trimmed.is_empty() {
            blocks.extend(current.take());
            in_fence ^= fence;
            continue;
        }
        let heading = trimmed.starts_with('#');
        let own_block = heading || trimmed.starts_with('|');
        if own_block || starts_list_item(trimmed) {
            blocks.extend(current.take());
        }
        if heading {
            section = trimmed.trim_start_matches('#').trim().to_string();
        }
        let block = current.get_or_insert_with(|| Block {
            section: section.clone(),
            text: String::new(),
            starts: Vec::new(),
        });
        block.push_line(line, number);
        if own_block {
            blocks.extend(current.take());
        }
    }
    blocks.extend(current);
    blocks
}

fn starts_list_item(trimmed: &str) -> bool {
    let digits = trimmed.bytes().take_while(u8::is_ascii_digit).count();
    trimmed.starts_with("- ")
        || trimmed.starts_with("* ")
        || (digits > 0 && trimmed[digits..].starts_with(". "))
}

/// The code spans of `text`, in order: a run of backticks up to the next run of as many.
pub fn code_spans(text: &str) -> Vec<Span> {
    let bytes = text.as_bytes();
    let run = |at: usize| bytes[at..].iter().take_while(|&&b| b == b'`').count();
    let mut spans = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        if bytes[at] != b'`' {
            at += 1;
            continue;
        }
        let open = run(at);
        let mut close = at + open;
        let found = loop {
            match text[close..].find('`') {
                None => break None,
                Some(next) => {
                    let next = close + next;
                    let length = run(next);
                    if length == open {
                        break Some(next);
                    }
                    close = next + length;
                }
            }
        };
        match found {
            Some(close) => {
                spans.push(Span {
                    text: text[at + open..close].trim().to_string(),
                    start: at,
                    end: close + open,
                });
                at = close + open;
            }
            None => at += open,
        }
    }
    spans
}

/// The targets of the links and images of `text` outside code spans (`[text](target)`),
/// each with its offset in `text`.
pub fn links(text: &str) -> Vec<(String, usize)> {
    let spans = code_spans(text);
    let in_code = |at: usize| spans.iter().any(|s| s.start <= at && at < s.end);
    let mut links = Vec::new();
    let mut from = 0;
    while let Some(found) = text[from..].find("](") {
        let open = from + found + 2;
        from = open;
        if in_code(open) {
            continue;
        }
        if let Some(close) = text[open..].find(')') {
            let target = &text[open..open + close];
            if !target.is_empty() && !target.contains(char::is_whitespace) {
                links.push((target.to_string(), open));
            }
        }
    }
    links
}

/// The anchor a heading gets (GitHub's rule): lower case, letters, digits, `-` and `_`
/// kept, spaces made `-`, everything else dropped.
pub fn anchor(heading: &str) -> String {
    heading
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}
