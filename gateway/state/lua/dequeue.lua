-- dequeue: ARGV 4 entry id. Reply 1 if it was queued, else 0.
expire_queue()
return finish(leave(ARGV[4], false) and 1 or 0)
