from peerinfer.cli import entry

entry()
