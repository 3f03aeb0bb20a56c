"""`agentrl view`: see what the agent did, token by token, in a local web page.

data.py reads run dirs and eval dirs as they are on disk (a step's summaries first, a trajectory on
demand); server.py serves them and page.html (FastAPI, no front-end build); embed.py puts the same page,
with its data, into `agentrl report`'s single HTML file.
"""
