"""Starting and talking to the serving stack: the plan of a fleet, its replicas and pool servers, the
client, the engines' counters, the random model, the prompts."""
