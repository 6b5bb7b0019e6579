"""Text in and out: encoding prompts (chat template or raw), streaming decode, stop strings."""

from __future__ import annotations

from datetime import datetime

from tokenizers import Tokenizer

from .bundle import TokenizerSpec
from .errors import BundleError, InputError


def _raise(message: str):
    raise InputError(f"chat template error: {message}")


class TextCodec:
    """The bundle's tokenizer plus its chat template."""

    def __init__(self, spec: TokenizerSpec):
        self.spec = spec
        try:
            self.tokenizer = Tokenizer.from_file(str(spec.file))
        except Exception as err:
            raise BundleError(f"the tokenizer {spec.file} could not be read ({err}); re-export the bundle") from None
        self._template = None
        if spec.chat_template:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(spec.chat_template)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def apply_chat_template(self, prompt: str) -> str:
        """The chat text of one user turn, ending where the assistant's answer starts."""
        return self.render_chat([{"role": "user", "content": prompt}], add_generation_prompt=True)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The chat template applied to `messages` ({"role", "content"} dicts)."""
        special = self.spec.special_tokens
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=special.get("bos_token") or "",
                                     eos_token=special.get("eos_token") or "")

    def encode_prompt(self, prompt: str, chat: bool | None = None) -> list[int]:
        """Token ids of a prompt; chat=None applies the chat template when the bundle has one."""
        if not prompt:
            raise InputError("the prompt is empty; pass some text to generate from")
        use_chat = self.has_chat_template if chat is None else chat
        if use_chat and not self.has_chat_template:
            raise InputError("this bundle's tokenizer has no chat template; use --no-chat (chat=False)")
        if use_chat:
            # the template writes its own special tokens (bos included where the model wants one)
            return self.tokenizer.encode(self.apply_chat_template(prompt), add_special_tokens=False).ids
        ids = self.tokenizer.encode(prompt, add_special_tokens=False).ids
        if self.spec.add_bos_token and self.spec.bos_token_id is not None:
            ids = [self.spec.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class TextStream:
    """Turns a growing list of token ids into text pieces that are safe to show.

    Holds back an incomplete UTF-8 character (decoded as U+FFFD) and any tail that could
    still become a stop string; `finish` reports whether a stop string was hit and cuts it off.
    """

    def __init__(self, codec: TextCodec, stop: tuple[str, ...] = ()):
        self.codec, self.stop = codec, tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.shown = 0          # characters of the decoded text already handed out
        self.text = ""          # decoded text so far, cut at a stop string once one is hit
        self.stopped = False

    def push(self, new_ids: list[int]) -> str:
        """Add tokens; return the new text that can be shown now."""
        self.ids.extend(new_ids)
        text = self.codec.decode(self.ids)
        safe_end = len(text)
        for s in self.stop:
            at = text.find(s, max(0, self.shown - len(s)))
            if at != -1:
                self.stopped = True
                text, safe_end = text[:at], at
                break
        if not self.stopped:
            while safe_end > 0 and text[safe_end - 1] == "\ufffd":
                safe_end -= 1
            for s in self.stop:  # hold back a tail that is a prefix of a stop string
                for n in range(min(len(s) - 1, safe_end), 0, -1):
                    if text.endswith(s[:n], 0, safe_end):
                        safe_end -= n
                        break
        self.text = text
        piece = text[self.shown:max(safe_end, self.shown)]
        self.shown = max(safe_end, self.shown)
        return piece

    def flush(self) -> str:
        """At the end of generation: everything not shown yet (minus a stop string)."""
        piece = self.text[self.shown:]
        self.shown = len(self.text)
        return piece
