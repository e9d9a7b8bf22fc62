"""The ``dataset`` task: prompts from the user's own data, read with Hugging Face ``datasets``.

A parquet, JSON/JSONL or CSV file, a folder written by ``Dataset.save_to_disk``, or (with
network) a hub id. Two row layouts are recognised without configuration:

* **verl**: ``prompt`` is a list of chat messages, the ground truth is
  ``reward_model.ground_truth``, and ``data_source``, ``ability``, ``extra_info`` ride along;
* **TRL**: ``prompt`` is a string or a list of chat messages; an ``answer``, ``solution`` or
  ``ground_truth`` column is the answer; every other column rides along.

Other layouts name their fields with ``prompt_key`` / ``answer_key`` (a dotted path reaches
into a nested field, e.g. ``reward_model.ground_truth``). Every field of the row
reaches the reward (``Prompt.columns``; the prompt too, as the row has it). Chat messages go through the model's own chat template
(``tokenizer.apply_chat_template(..., add_generation_prompt=True)``) and reach the engine as
token ids; plain strings are used as they are.

A row that cannot be a prompt (no prompt field, an empty one, a prompt that is neither text
nor chat messages, messages of an unknown role, no answer field, a null answer where ``answer_key``
names it) is left out when the task is built, and
the count is printed with the first such row. A row the model's chat template refuses
when it is handed out (roles out of order) is passed over for the next row of that epoch's
sequence, with a warning; no single row ends a run. Chat content is text: a control token's
string inside a message stays text (``chat/content_as_text.py``).

Order: the rows are shuffled once per epoch from ``seed`` (``run.seed`` unless set), and step
``s`` takes the rows ``s * n .. s * n + n - 1`` of that sequence. The position in the dataset is
therefore a function of the step, which the checkpoint holds: a resumed run hands out exactly
the prompts the uninterrupted run would have, neither repeating nor skipping one.
"""

from __future__ import annotations

import random
import sys
import warnings
from collections import OrderedDict
from typing import Any

from streamrl.api import Prompt, Task
from streamrl.chat import content_as_text
from streamrl.chat.messages import MAX_CHARS_PER_TOKEN, MessageError, normalize, template_messages
from streamrl.errors import RunWarning, UserError
from streamrl.models.tokenizers import encode_text, load_tokenizer
from streamrl.tasks.dataset_config import DatasetConfig
from streamrl.tasks.dataset_files import Rows, dig, is_chat, load_rows, one_split
from streamrl.telemetry.text import message_line

#: Columns taken as the answer when ``answer_key`` is not set, after verl's ground truth.
ANSWER_COLUMNS = ("answer", "solution", "ground_truth")

#: Rows handed out that cannot be prompts, with none that could, before the run stops: the
#: template or its settings refuse them all (a system message to a template without that role).
REFUSED_BEFORE_ANY = 20

#: Rows passed over with a warning each; those after are passed over and counted, not printed.
WARNED_ROWS = 5

#: Rendered prompts kept for rows handed out again (the latest ones; a few MB of token ids).
PROMPTS_KEPT = 4096


class TooLong(ValueError):
    """A row's prompt is longer than the model takes (``prompt_positions``)."""


def _excerpt(row: Any) -> str:
    """The start of a row as text, to name it in a message (a row has no name of its own)."""
    text = repr(row)
    return text if len(text) <= 120 else text[:117] + "..."


class DatasetTask(Task):
    """Hands out the rows of a dataset as prompts; see the module docstring."""

    def __init__(self, config: DatasetConfig, where: str = "task"):
        self.config = config
        self.where = where
        """The recipe table its settings come from, as its errors name it (``task``, or an agent
        task's ``task.data``)."""
        self._tokenizer = None
        alone = one_split(config.path)
        if config.split != "train" and alone:  # (said, not ignored: it trained on the file)
            raise UserError(f"{self.where}.split: {config.path} is {alone}, one split; a split ({config.split!r}) "
                            "is chosen from a saved DatasetDict or a hub dataset")
        rows = load_rows(config.path, config.split, f"{self.where}.path")
        if not rows:
            raise UserError(f"{self.where}.path: {config.path} has no rows")
        if config.prompt_key not in rows[0]:
            raise UserError(f"{self.where}.prompt_key: the rows of {config.path} have no field {config.prompt_key!r} "
                            f"(they have {', '.join(sorted(rows[0]))})")
        self.answer_key = config.answer_key or self._default_answer_key(rows[0])
        held_out: Rows = rows.take([])
        if config.eval_split and not config.eval_path and alone:
            raise UserError(f"{self.where}.eval_split: {config.path} is {alone}, one split; hold rows out with "
                            "eval_fraction, or name a held-out file with eval_path")
        if config.eval_split not in (None, "train") and one_split(config.eval_path):
            raise UserError(f"{self.where}.eval_split: {config.eval_path} is {one_split(config.eval_path)}, one split; "
                            "leave eval_split out to hold out the whole file")
        if config.eval_path or config.eval_split:
            held_out = load_rows(config.eval_path or config.path, config.eval_split or "train",
                                 f"{self.where}.eval_path" if config.eval_path else f"{self.where}.eval_split")
        elif config.eval_fraction:
            order = list(range(len(rows)))
            random.Random(config.seed * 1_000_003 - 1).shuffle(order)
            cut = set(order[:max(1, int(len(rows) * config.eval_fraction))])
            held_out = rows.take(i for i in range(len(rows)) if i in cut)
            rows = rows.take(i for i in range(len(rows)) if i not in cut)
            if not rows:
                raise UserError(f"{self.where}.eval_fraction: holding out {config.eval_fraction} of {len(cut)} rows "
                                "leaves none to train on")
        # rows become prompts when first handed out (a chat template needs the model's tokenizer)
        self.rows, self.held_out_rows = rows, held_out[:config.eval_max]
        # a held-out file may have a layout of its own
        self.eval_answer_key = config.answer_key or (self._default_answer_key(held_out[0]) if held_out else None)
        self.rows = self._usable_rows(self.rows, f"{self.where}.path", held_out=False)
        if self.held_out_rows:
            self.held_out_rows = self._usable_rows(self.held_out_rows, "the held-out rows", held_out=True)
        self._passed_over: set[int] = set()  # rows the chat template refused when handed out
        # the rows handed out lately, rendered: a row asked for again soon is not rendered again,
        # and a run of many epochs over a large dataset holds a bounded number of them
        self._prompts: OrderedDict[int, Prompt] = OrderedDict()
        self._rendered_any = False  # (whether any row has rendered: a template that refuses all stops the run)
        self._refused = 0  # rows handed out that the template or the tokenizer refused
        self._template_error: str | None = None  # the first row the template refused, when measured at the start
        if config.max_prompt_tokens:
            before = len(self.rows)
            self.rows = self.rows.take([i for i, r in enumerate(self.rows) if self._fits(r, held_out=False)])
            self.held_out_rows = self.held_out_rows.take(
                [i for i, r in enumerate(self.held_out_rows) if self._fits(r, held_out=True)])
            if not self.rows and self._template_error is not None:
                raise UserError(f"{self.where}.path: no row of {config.path} can be a prompt for this model (the "
                                f"first: {self._template_error})")
            if not self.rows:
                raise UserError(f"{self.where}.max_prompt_tokens: every prompt of {config.path} is longer than "
                                f"{config.max_prompt_tokens} tokens")
            if len(self.rows) < before:  # said once, here: the run then goes on with the rest
                print(f"task: {before - len(self.rows)} of {before} prompts are longer than "
                      f"max_prompt_tokens = {config.max_prompt_tokens} (or the chat template refuses them) and "
                      "are left out", file=sys.stderr)
        self._orders: dict[int, list[int]] = {}

    # -- rows to prompts ------------------------------------------------------------------------
    def _row_problem(self, row: Any, held_out: bool) -> str | None:
        """Why ``row`` cannot become a prompt, found without the tokenizer; None when it can."""
        key = self.config.prompt_key
        if not isinstance(row, dict) or key not in row:
            return f"no field {key!r}"
        value = row[key]
        if is_chat(value):
            try:
                normalize(value)
            except MessageError as exc:
                return f"{key}{str(exc).removeprefix('messages')}"
        elif not isinstance(value, str):
            return (f"{key!r} is neither a string nor a list of {{role, content}} messages "
                    f"(got {type(value).__name__})")
        elif not value and not self.config.system_prompt:  # (no tokens at all for a model without BOS)
            return f"{key!r} is empty"
        answer_key = self.eval_answer_key if held_out else self.answer_key
        try:
            # (a column's table gives every row each column: a row without the answer has null;
            # left out where the recipe named the answer's field, kept where it was guessed: a
            # reward or an agent may need no answer)
            if answer_key and dig(row, answer_key) is None and self.config.answer_key:
                return f"{answer_key!r} is null"
        except KeyError:
            return f"no field {answer_key!r}"
        return None

    def _characters(self, row: dict) -> int:
        """How many characters ``row``'s prompt has before a chat template renders it (its
        messages' text and tool calls, and the system prompt)."""
        value = row[self.config.prompt_key]
        chars = len(self.config.system_prompt or "")
        if not is_chat(value):
            return chars + len(value)
        for m in normalize(value):
            chars += len(m["content"]) + sum(len(c["function"]["name"]) + len(c["function"]["arguments"])
                                             for c in m.get("tool_calls", ()))
        return chars

    def _fits(self, row: dict, held_out: bool) -> bool:
        """Whether ``row``'s prompt is at most ``max_prompt_tokens`` long (False: the chat template
        refuses it). A prompt of more characters than the limit could hold is left out before it
        is rendered or tokenized (a row of megabytes would take seconds to count)."""
        if self._characters(row) > self.config.max_prompt_tokens * MAX_CHARS_PER_TOKEN:
            return False
        try:
            return self._length(self._prompt_of(row, held_out=held_out)) <= self.config.max_prompt_tokens
        except UserError:
            raise
        except Exception as exc:  # (a chat template's refusal: this row's alone)
            self._template_error = self._template_error or f"{type(exc).__name__}: {str(exc)[:200]}"
            return False

    def _usable_rows(self, rows: Rows, what: str, held_out: bool) -> Rows:
        """``rows`` without those that cannot be prompts, said once on stderr (count and first)."""
        kept, first, left = [], None, 0
        for i, row in enumerate(rows):
            problem = self._row_problem(row, held_out)
            if problem is None:
                kept.append(i)
            else:
                left += 1
                first = first or f"{problem}, in {_excerpt(row)}"
        if not kept:
            raise UserError(f"{what}: no row of {self.config.path} can be a prompt (the first: {first})")
        if left:
            print(f"task: {left} of {len(rows)} rows of {what} cannot be prompts and are left out (the first, "
                  f"{first[:300]})", file=sys.stderr)
        return rows.take(kept)

    @staticmethod
    def _default_answer_key(row: dict) -> str | None:
        try:
            dig(row, "reward_model.ground_truth")
            return "reward_model.ground_truth"
        except KeyError:
            return next((c for c in ANSWER_COLUMNS if c in row), None)

    def _messages(self, value: Any) -> list[dict] | None:
        """The chat messages a prompt becomes (None: a plain string, used as it is)."""
        if not is_chat(value) and not self.config.system_prompt:
            return None
        messages = list(value) if is_chat(value) else [{"role": "user", "content": str(value)}]
        if self.config.system_prompt and not (messages and messages[0]["role"] == "system"):
            messages = [{"role": "system", "content": self.config.system_prompt}, *messages]
        return messages

    def _prompt_of(self, row: dict, uid: str = "", held_out: bool = False) -> Prompt:
        """A row as a ``Prompt`` (``uid``: set when it is handed out; ``held_out``: a row of the
        evaluation set, whose answer may sit elsewhere)."""
        if self.config.prompt_key not in row:
            raise UserError(f"{self.where}.prompt_key: a row has no field {self.config.prompt_key!r} "
                            f"(it has {', '.join(sorted(row))})")
        value = row[self.config.prompt_key]
        key = self.eval_answer_key if held_out else self.answer_key
        try:
            answer = dig(row, key) if key else None
        except KeyError:
            raise UserError(f"{self.where}.answer_key: a row has no field {key!r} (it has {', '.join(sorted(row))})") from None
        columns = dict(row)  # the prompt too, as written (a TRL reward gets chat prompts as messages)
        messages = self._messages(value)
        if messages is not None:
            if self.tokenizer.chat_template is None:
                raise UserError(f"task: the tokenizer of {self.config.model_path} has no chat template, and the "
                                f"dataset's prompts are chat messages (or {self.where}.system_prompt is set)")
            # content is text: a control token's string in a message does not become that token
            guarded, contents = content_as_text.guard(self.tokenizer, template_messages(normalize(messages)))
            text = self.tokenizer.apply_chat_template(guarded, add_generation_prompt=True, tokenize=False,
                                                      **self.config.chat_template_kwargs)
            ids = content_as_text.encode(self.tokenizer, text, contents)
            return Prompt(uid=uid, text=content_as_text.unguard(text, contents), answer=answer,
                          token_ids=list(ids), columns=columns)
        if not isinstance(value, str):
            raise UserError(f"{self.where}.prompt_key: a row's {self.config.prompt_key!r} is neither a string nor a list "
                            f"of {{role, content}} messages (got {type(value).__name__})")
        return Prompt(uid=uid, text=value, answer=answer, columns=columns)

    @property
    def tokenizer(self):
        """The model's tokenizer (loaded on first use: a plain-string dataset needs none, unless
        its prompts are counted in tokens)."""
        if self._tokenizer is None:
            if not self.config.model_path:
                raise UserError("task: chat prompts need the model's tokenizer; add a [model] table "
                                f"(or set {self.where}.model_path)")
            try:
                self._tokenizer = load_tokenizer(self.config.model_path)
            except Exception as exc:  # (the run's, not a row's: said once, not counted per row)
                raise UserError(f"{self.where}.model_path: cannot load a tokenizer from {self.config.model_path} "
                                f"({type(exc).__name__}: {message_line(exc, 200)})") from None
        return self._tokenizer

    def _length(self, prompt: Prompt) -> int:
        if prompt.token_ids is not None:
            return len(prompt.token_ids)
        return len(encode_text(self.tokenizer, prompt.text))  # (as the engine encodes it: a BOS where it adds one)

    def _fitting_prompt(self, row: dict, uid: str = "", held_out: bool = False, hint: str = "") -> Prompt:
        """``row`` as a prompt, rendered once; ValueError (``hint`` added) where it is longer than
        the model takes (``prompt_positions``), counted in characters first, so a row of megabytes
        is never rendered or tokenized."""
        limit = self.config.prompt_positions
        if limit is None or self.config.max_prompt_tokens:  # (max_prompt_tokens dropped such rows at build)
            return self._prompt_of(row, uid, held_out=held_out)
        chars = self._characters(row)
        if chars > limit * MAX_CHARS_PER_TOKEN:
            raise TooLong(f"its prompt is longer than the {limit} tokens the model takes ({chars} characters){hint}")
        prompt = self._prompt_of(row, uid, held_out=held_out)
        tokens = self._length(prompt)
        if tokens > limit:
            raise TooLong(f"its prompt is longer than the {limit} tokens the model takes ({tokens} tokens){hint}")
        return prompt

    def _row(self, order: list[int], at: int) -> Prompt:
        """The prompt at position ``at`` of an epoch's ``order``: the first row from there on that
        renders and fits the model (a row the chat template refuses, or longer than
        ``prompt_positions``, is passed over, with a warning, for good)."""
        first_error = None
        for k in range(len(order)):
            index = order[(at + k) % len(order)]
            if index in self._passed_over:
                continue
            if index not in self._prompts:
                try:
                    self._prompts[index] = self._fitting_prompt(
                        self.rows[index], hint=": its positions less engine.max_new_tokens; set "
                                               f"{self.where}.max_prompt_tokens to drop such rows at the start")
                    self._rendered_any = True
                    if len(self._prompts) > PROMPTS_KEPT:
                        self._prompts.popitem(last=False)
                except UserError:
                    raise
                except Exception as exc:  # (a chat template's refusal, a tokenizer's error: this row's)
                    self._passed_over.add(index)
                    error = f"{type(exc).__name__}: {str(exc)[:200]}"
                    first_error = first_error or error
                    self._refused += not isinstance(exc, TooLong)  # (a long row says nothing of the others)
                    if not self._rendered_any and self._refused >= REFUSED_BEFORE_ANY:
                        # not one row has rendered: the template or its settings refuse them all,
                        # and a warning per row of a large file would be all the run says
                        raise UserError(f"{self.where}.path: none of the first {len(self._passed_over)} rows of "
                                        f"{self.config.path} can be a prompt for this model ({error})") from None
                    if len(self._passed_over) <= WARNED_ROWS:
                        more = (f"; further such rows are passed over without a warning each"
                                if len(self._passed_over) == WARNED_ROWS else "")
                        warnings.warn(f"task: a row of {self.config.path} cannot be a prompt and is passed over "
                                      f"({error}): {_excerpt(self.rows[index])}{more}", RunWarning, stacklevel=2)
                    continue
            self._prompts.move_to_end(index)
            return self._prompts[index]
        raise UserError(f"{self.where}.path: no row of {self.config.path} can be a prompt for this model "
                        f"(the last: {first_error})")

    # -- the Task contract ----------------------------------------------------------------------
    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.rows)))
            random.Random(self.config.seed * 1_000_003 + epoch).shuffle(order)
            self._orders = {epoch: order}  # one epoch at a time is all a run needs
        return self._orders[epoch]

    def prompts(self, step: int, n: int) -> list[Prompt]:
        """Rows ``step * n .. step * n + n - 1`` of the per-epoch shuffled sequence."""
        out = []
        for i in range(n):
            epoch, at = divmod(step * n + i, len(self.rows))
            if self.config.epochs is not None and epoch >= self.config.epochs:
                last = self.config.epochs * len(self.rows) // n
                raise UserError(f"{self.where}.epochs: {self.config.epochs} epoch(s) of {len(self.rows)} prompts end after "
                                f"step {last} at {n} prompts per step; set run.steps <= {last} or raise {self.where}.epochs")
            row = self._row(self._order(epoch), at)
            out.append(Prompt(uid=f"{step}-{i:03d}", text=row.text, answer=row.answer, token_ids=row.token_ids,
                              columns=row.columns))
        return out

    def eval_prompts(self) -> list[Prompt]:
        """The held-out rows (``eval_path``, ``eval_split`` or ``eval_fraction``), in file order
        (a row the chat template refuses is left out, with a warning)."""
        out, refused = [], []
        for i, row in enumerate(self.held_out_rows):
            try:
                out.append(self._fitting_prompt(row, f"eval-{i}", held_out=True))
            except UserError:
                raise
            except Exception as exc:  # (a chat template's refusal: this row's alone)
                refused.append(f"{type(exc).__name__}: {str(exc)[:200]}, in {_excerpt(row)}")
        if refused:
            warnings.warn(f"task: {len(refused)} held-out rows cannot be prompts and are left out of the "
                          f"evaluation (the first, {refused[0]})", RunWarning, stacklevel=2)
        return out

    def __len__(self) -> int:
        return len(self.rows)

    # -- a tiny model for the data (``streamrl model init --task dataset``) ---------------------
    def _texts(self, row: dict) -> tuple[str, str]:
        """(the prompt's words, the response to warm-start on): the ``solution`` field when the
        row has a string one, else the answer."""
        value = row[self.config.prompt_key]
        if is_chat(value):  # (normalized: content as text, never None or a list of parts, and tool calls' text)
            words = " ".join(m["content"] + "".join(c["function"]["name"] + c["function"]["arguments"]
                                                    for c in m.get("tool_calls", ())) for m in normalize(value))
        else:
            words = str(value)
        solution = row.get("solution")
        if not isinstance(solution, str):
            try:
                solution = str(dig(row, self.answer_key)) if self.answer_key else ""
            except KeyError:
                solution = ""
        return words + (self.config.system_prompt or ""), solution

    @property
    def alphabet(self) -> str:
        """Every character of the prompts and responses (a character-level tokenizer's vocabulary)."""
        chars = set()
        for row in self.rows:
            chars.update("".join(self._texts(row)))
        return "".join(sorted(chars))

    def example(self, rng) -> tuple[str, str]:
        """A random row: (the prompt text as the engine sees it, the response to learn)."""
        row = rng.choice(self.rows)
        prompt = self._prompt_of(row)
        return prompt.text, self._texts(row)[1]

    def max_prompt_chars(self) -> int:
        """Longest prompt's words in characters, plus room for a chat template's few tokens."""
        return max(len(self._texts(r)[0]) for r in self.rows) + 16

    def max_response_chars(self) -> int:
        """Longest response to learn, in characters."""
        return max(len(self._texts(r)[1]) for r in self.rows)
