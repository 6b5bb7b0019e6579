"""Text in and out: encoding prompts (chat template or raw), streaming decode, stop strings."""

from __future__ import annotations

from tokenizers import Tokenizer

from .bundle import TokenizerSpec, check_tokenizer
from .chat_template import ChatTemplate, TemplateProblem
from .errors import BundleError, InputError


def check_text(text, what: str = "the prompt") -> str:
    """`text` as a str that is valid Unicode text: bytes that were not UTF-8 reach Python as lone
    surrogates (sys.argv, surrogateescape), which a tokenizer cannot take."""
    if not isinstance(text, str):
        raise InputError(f"{what} must be a string (got {type(text).__name__})")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raw = text[err.start].encode("utf-8", "surrogateescape")
        raise InputError(f"{what} is not valid UTF-8 text (byte 0x{raw.hex()} at character {err.start}); "
                         "pass UTF-8 text") from None
    return text


class TextCodec:
    """The bundle's tokenizer plus its chat template (compiled when first used, so a bundle whose
    template does not compile still serves raw prompts)."""

    def __init__(self, spec: TokenizerSpec):
        self.spec = spec
        try:
            self.tokenizer = Tokenizer.from_file(str(spec.file))
        except Exception as err:
            first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
            raise BundleError(f"the tokenizer {spec.file} could not be read ({first}); re-export the bundle") from None
        check_tokenizer(spec, self.tokenizer.get_vocab(with_added_tokens=True))
        self._template: ChatTemplate | None = None

    @property
    def has_chat_template(self) -> bool:
        return bool(self.spec.chat_template)

    def _chat_template(self) -> ChatTemplate:
        if self._template is None:
            try:
                self._template = ChatTemplate(self.spec.chat_template)
            except TemplateProblem as err:
                raise BundleError(f"{err} (spectr.json tokenizer.chat_template); use --no-chat (chat=False) "
                                  "or re-export the bundle") from None
        return self._template

    def apply_chat_template(self, prompt: str) -> str:
        """The chat text of one user turn, ending where the assistant's answer starts."""
        return self.render_chat([{"role": "user", "content": prompt}], add_generation_prompt=True)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The chat template applied to `messages` ({"role", "content"} dicts)."""
        special = self.spec.special_tokens
        template = self._chat_template()
        try:
            return template.render(messages, add_generation_prompt, bos_token=special.get("bos_token") or "",
                                   eos_token=special.get("eos_token") or "")
        except TemplateProblem as err:
            raise InputError(f"chat template error: {err}") from None

    def encode_prompt(self, prompt: str, chat: bool | None = None) -> list[int]:
        """Token ids of a prompt; chat=None applies the chat template when the bundle has one."""
        check_text(prompt)
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

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation rendered with the chat template, ending where the assistant's
        next message starts."""
        if not self.has_chat_template:
            raise InputError("this bundle's tokenizer has no chat template, so it cannot take messages; "
                             "use generate with a plain prompt")
        return self.tokenizer.encode(self.render_chat(messages, add_generation_prompt=True),
                                     add_special_tokens=False).ids

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

    def kept_ids(self) -> list[int]:
        """The tokens behind `text`: all of them, or after a stop string the shortest prefix whose
        decoded text still starts with `text` (the tokens up to the one in which the stop string
        starts; when it starts on a token boundary, decode(kept_ids()) == text exactly)."""
        n = len(self.ids)
        if self.stopped:
            while n > 0 and self.codec.decode(self.ids[:n - 1]).startswith(self.text):
                n -= 1
        return self.ids[:n]

    def flush(self) -> str:
        """At the end of generation: everything not shown yet (minus a stop string)."""
        piece = self.text[self.shown:]
        self.shown = len(self.text)
        return piece
