"""``localai run MODEL [PROMPT]``: one-shot, from stdin, or an interactive chat."""

from __future__ import annotations

import sys
from typing import Any

import click

from localai.cli import cli, fail_cleanly

HELP = """Available commands:
  /set parameter NAME VALUE   set a sampling parameter (e.g. /set parameter temperature 0.2)
  /set system TEXT            set the system prompt
  /show parameters            show the parameters set in this session
  /clear                      forget the conversation
  /bye                        exit
  /?                          this help"""


class Chat:
    """One conversation with a model through the daemon's ``/api/chat``."""

    def __init__(self, client: Any, model: str, keep_alive: str | None, verbose: bool) -> None:
        self.client = client
        self.model = model
        self.keep_alive = keep_alive
        self.verbose = verbose
        self.messages: list[dict[str, str]] = []
        self.options: dict[str, Any] = {}
        self.system: str | None = None

    def send(self, prompt: str) -> bool:
        """Stream the reply to stdout. Returns False when cancelled with Ctrl-C."""
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + self.messages
        messages.append({"role": "user", "content": prompt})
        body: dict[str, Any] = {"model": self.model, "messages": messages, "stream": True, "options": self.options}
        if self.keep_alive is not None:
            body["keep_alive"] = self.keep_alive
        reply: list[str] = []
        stream = self.client.stream("/api/chat", body)
        try:
            for item in stream:
                text = item.get("message", {}).get("content", "")
                if text:
                    reply.append(text)
                    click.echo(text, nl=False)
                    sys.stdout.flush()
                if item.get("done"):
                    click.echo()
                    if self.verbose:
                        _print_stats(item)
        except KeyboardInterrupt:
            stream.close()  # closing the connection cancels the generation in the daemon
            click.echo()
            return False
        self.messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": "".join(reply)}]
        return True

    def command(self, line: str) -> bool:
        """Handle a slash command; False means exit."""
        words = line.split()
        if words[0] in ("/bye", "/exit"):
            return False
        if words[0] == "/clear":
            self.messages = []
            click.echo("Cleared session context")
        elif words[0] == "/set" and len(words) >= 4 and words[1] == "parameter":
            self._set_parameter(words[2], " ".join(words[3:]))
        elif words[0] == "/set" and len(words) >= 3 and words[1] == "system":
            self.system = line.split(None, 2)[2]
            click.echo("Set system message.")
        elif words[0] == "/show" and len(words) >= 2 and words[1] == "parameters":
            for name, value in self.options.items():
                click.echo(f"{name:<20} {value}")
        elif words[0] in ("/?", "/help"):
            click.echo(HELP)
        else:
            click.echo(f"Unknown command '{words[0]}'. Type /? for help")
        return True

    def _set_parameter(self, name: str, value: str) -> None:
        from localai.errors import ModelfileError
        from localai.models.modelfile import PARAMETERS, coerce_parameter

        if name not in PARAMETERS:
            click.echo(f"Unknown parameter '{name}'")
            return
        try:
            self.options[name] = coerce_parameter(name, value, "/set parameter")
        except ModelfileError as exc:
            click.echo(exc.message)
            return
        click.echo(f"Set parameter '{name}' to '{value}'")


def _print_stats(item: dict[str, Any]) -> None:
    def rate(count: int, nanos: int) -> str:
        return f"{count / (nanos / 1e9):.2f} tokens/s" if nanos else "n/a"

    click.echo(f"total duration:       {item['total_duration'] / 1e9:.3f}s", err=True)
    click.echo(f"prompt eval count:    {item['prompt_eval_count']} token(s) "
               f"({item.get('prompt_cache_count', 0)} cached)", err=True)
    click.echo(f"prompt eval rate:     {rate(item['prompt_eval_count'] - item.get('prompt_cache_count', 0), item['prompt_eval_duration'])}", err=True)  # noqa: E501
    click.echo(f"eval count:           {item['eval_count']} token(s)", err=True)
    click.echo(f"eval rate:            {rate(item['eval_count'], item['eval_duration'])}", err=True)


@cli.command()
@click.argument("model")
@click.argument("prompt", nargs=-1)
@click.option("--keepalive", default=None, help="How long the model stays loaded (e.g. 5m, 0, -1).")
@click.option("--verbose", is_flag=True, help="Print timings after each response.")
@fail_cleanly
def run(model: str, prompt: tuple[str, ...], keepalive: str | None, verbose: bool) -> None:
    """Chat with a model: one-shot with PROMPT or stdin, else interactively."""
    from localai.client import Client

    client = Client()
    client.ensure_running()
    client.request("POST", "/api/show", {"model": model})  # a clear error now if it is not installed
    chat = Chat(client, model, keepalive, verbose)
    text = " ".join(prompt)
    if not sys.stdin.isatty():
        piped = sys.stdin.read()
        text = f"{text}\n{piped}".strip() if text else piped.strip()
    if text:
        if not chat.send(text):
            sys.exit(130)
        return
    interactive(chat)


def interactive(chat: Chat) -> None:
    click.echo("Send a message (/? for help)")
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            click.echo()
            return
        except KeyboardInterrupt:
            click.echo("\nUse Ctrl-D or /bye to exit.")
            continue
        if not line.strip():
            continue
        if line.startswith("/"):
            if not chat.command(line.strip()):
                return
            continue
        chat.send(line)
