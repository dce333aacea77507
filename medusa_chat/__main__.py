from medusa_chat.cli import main

raise SystemExit(main())
