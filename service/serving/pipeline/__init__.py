"""The one request pipeline every protocol calls (callable and tested without HTTP), and the rendering of its answers
into plain response bodies."""
