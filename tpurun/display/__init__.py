"""What a person reads: plain lines, the live view, and the tables of the one-shot commands."""
