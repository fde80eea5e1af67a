"""What the page shares across users, with no Gradio in it: the app (`server.App`), the per-tab session store
(`store`) and the server-wide KV account (`accounting`)."""

from kvdemo.serve.accounting import KVAccount
from kvdemo.serve.server import App
from kvdemo.serve.store import ServerFull, SessionStore, UserSession

__all__ = [
    "App",
    "KVAccount",
    "ServerFull",
    "SessionStore",
    "UserSession",
]
