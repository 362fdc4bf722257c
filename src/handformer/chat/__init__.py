"""Chatting with an instruction-tuned model.

* :mod:`~handformer.chat.template`: a conversation turned into the prompt text the model
  expects, by the model's own Jinja chat template;
* :mod:`~handformer.chat.sandbox`: the sandbox and budget that template (a stranger's code)
  renders in;
* :mod:`~handformer.chat.session`: :class:`ChatSession`, the history and streamed replies
  (what ``handformer chat`` and the server's chat run).
"""

from handformer.chat.session import ChatSession, check_chat_model
from handformer.chat.template import ChatTemplateError, render_chat_template

__all__ = ["ChatSession", "ChatTemplateError", "check_chat_model", "render_chat_template"]
